"""``fsdp_cpu_offload`` (and stock LoRA configs' ``fsdp: {cpu_offload: ...}``) on CPU/gloo:
accepted, a one-line warning that there is nothing to offload (FSDP2's CPUOffloadPolicy needs an
accelerator to pin memory: "Cannot access accelerator device when none is available"), and the
same losses as off. The offload itself (CUDA) has not been run yet."""

import pytest
import torch

from helpers import losses, tune

pytestmark = pytest.mark.integration


def test_fsdp_cpu_offload_on_cpu_runs_as_off(tmp_path):
    runs = {}
    for name, override in (("off", "fsdp_cpu_offload=False"), ("flat", "fsdp_cpu_offload=True")):
        out = tmp_path / name
        # One rank: the offload is a no-op on the CPU at any world size, and reading the key is
        # all this checks. The fsdp section's form (fsdp.cpu_offload) is read on two ranks in the
        # test below, for the full and KD recipes; all three recipes read both forms through the
        # same library function (fsdp_options; tests/unit/test_validation.py checks each calls it),
        # so a LoRA run of the section form would add CI time without covering more.
        proc = tune("run", "--nproc_per_node", "1", "lora_finetune_distributed", "--config",
                    "tiny/lora_distributed", f"output_dir={out}", "max_steps_per_epoch=2", override)
        assert ("nothing to offload" in proc.stdout + proc.stderr) == (name != "off")
        runs[name] = losses(out)
    assert len(runs["off"]) == 2
    torch.testing.assert_close(torch.tensor(runs["flat"]), torch.tensor(runs["off"]), rtol=0, atol=0)


@pytest.mark.parametrize("recipe,config", [
    ("full_finetune_distributed", "tiny/full_distributed"),
    ("knowledge_distillation_distributed", "tiny/kd_distributed"),  # student and teacher
])
def test_every_distributed_recipe_reads_the_fsdp_section(recipe, config, tmp_path):
    # Before, only lora_finetune_distributed declared `fsdp`: the others refused
    # fsdp.cpu_offload=True as "not implemented" although they shard with the same offload.
    proc = tune("run", "--nproc_per_node", "2", recipe, "--config", config,
                f"output_dir={tmp_path}", "max_steps_per_epoch=1", "fsdp_cpu_offload=null",
                "fsdp.cpu_offload=True")
    out = proc.stdout + proc.stderr
    assert "nothing to offload" in out and "not implemented" not in out
    assert len(losses(tmp_path)) == 1
