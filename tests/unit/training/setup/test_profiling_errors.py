"""tune_recipes.training.setup.profiling: a trace folder that cannot be made is one line when
the run starts, not a traceback when the first trace is written."""

import pytest
import torch
from omegaconf import OmegaConf

from tune_recipes.config import ConfigError
from tune_recipes.training.setup.profiling import setup_profiler

pytestmark = pytest.mark.unit


def test_an_output_dir_that_cannot_be_made_is_one_line_at_setup(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder should be: fails for root too
    cfg = OmegaConf.create({"enabled": True, "output_dir": str(blocker / "traces")})
    with pytest.raises(ConfigError, match=f"profiler.output_dir={blocker / 'traces'}: cannot "
                                          "create it"):
        setup_profiler(cfg, output_dir=str(tmp_path), device=torch.device("cpu"))
    ok = setup_profiler(OmegaConf.create({"enabled": True}), output_dir=str(tmp_path),
                        device=torch.device("cpu"))
    assert ok is not None and (tmp_path / "profiling_outputs").is_dir()
