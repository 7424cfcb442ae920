"""Each shipped quantize config reads the files its QAT config's run writes.

torchtune's HF checkpointer writes ``model-0000i-of-0000N.safetensors`` for N input files (one
input file ``model.safetensors`` comes out as ``model-00001-of-00001.safetensors``).
"""

import pytest
from omegaconf import OmegaConf

from tune_recipes._cli import registry

pytestmark = pytest.mark.unit
QUANTIZE = [c for c in registry.list_configs()
            if c.endswith("_quantize") and not c.startswith("tiny/")]


def _written_by(checkpoint_files):
    if OmegaConf.is_dict(checkpoint_files):
        n = int(checkpoint_files.max_filename)
    else:
        n = len(checkpoint_files)
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _read_by(checkpoint_files):
    if OmegaConf.is_dict(checkpoint_files):
        n = int(checkpoint_files.max_filename)
        fmt = checkpoint_files.filename_format
        return [fmt.format(f"{i:05d}", f"{n:05d}") for i in range(1, n + 1)]
    return list(checkpoint_files)


@pytest.mark.parametrize("name", QUANTIZE)
def test_quantize_config_reads_what_qat_writes(name):
    qat = name.replace("_quantize", "_qat_single_device")
    q_cfg = OmegaConf.load(registry.resolve_config(name).path)
    t_cfg = OmegaConf.load(registry.resolve_config(qat).path)
    assert _read_by(q_cfg.checkpointer.checkpoint_files) == \
        _written_by(t_cfg.checkpointer.checkpoint_files), (name, qat)


def test_every_quantize_config_is_checked():
    assert len(QUANTIZE) == 3
