"""Measure what ``low_cpu_ram`` saves: peak extra anonymous CPU memory while a QLoRA model's
merged checkpoint is built and written, with the key off and on.

    python scripts/measure_low_cpu_ram.py                       # ~0.2B-parameter Llama-3 shape
    python scripts/measure_low_cpu_ram.py --dim 2048 --layers 16

Each mode runs in its own process (a fresh heap): a bf16 QLoRA model (NF4 base, LoRA on q/v and
the MLP) is built on the CPU; then, as CheckpointWriter does, the merged state dict is built
(off: ``model.state_dict()`` + copies + torchtune's merge; on: tune_recipes'
``file_backed_state_dict`` + ``merge_lora_in_place``) and written with safetensors' ``save_file``
(what torchtune's HF checkpointer calls per output file). A thread samples ``RssAnon`` (anonymous
resident memory, /proc/self/status) every 2 ms; reported: its peak above the level before the
save, for building the dict and for building + writing. File-backed pages of the scratch file
are page cache (RssFile), which the kernel writes back and may evict, so they are not counted.
Linux only.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakSampler:
    def __init__(self):
        self.peak = _rss_anon_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon_mib())
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon_mib())


def child(args) -> dict:
    import torch
    from safetensors.torch import save_file
    from torchtune import training
    from torchtune.models.llama3 import lora_llama3
    from torchtune.modules.peft import get_merged_lora_ckpt

    from tune_recipes.training.checkpointing.low_ram import (
        file_backed_state_dict,
        merge_lora_in_place,
    )

    torch.manual_seed(0)
    with training.set_default_dtype(torch.bfloat16):
        model = lora_llama3(
            lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=8,
            lora_alpha=16, quantize_base=True, vocab_size=args.vocab, num_layers=args.layers,
            num_heads=args.dim // 64, num_kv_heads=max(1, args.dim // 256), embed_dim=args.dim,
            max_seq_len=2048, intermediate_dim=args.hidden)
    params = sum(p.numel() for p in model.parameters())
    out = Path(tempfile.mkdtemp(prefix="measure_low_cpu_ram_"))
    base = _rss_anon_mib()
    t0 = time.perf_counter()
    with PeakSampler() as built:
        if args.mode == "on":
            sd = merge_lora_in_place(file_backed_state_dict(model, out), rank=8, alpha=16)
        else:
            sd = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            sd = get_merged_lora_ckpt(sd, rank=8, alpha=16)
    t1 = time.perf_counter()
    with PeakSampler() as written:
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    t2 = time.perf_counter()
    merged_mib = sum(v.numel() * v.element_size() for v in sd.values()) / 2**20
    (out / "model.safetensors").unlink()
    out.rmdir()
    return dict(mode=args.mode, params_m=round(params / 1e6, 1),
                merged_checkpoint_mib=round(merged_mib),
                peak_extra_build_mib=round(built.peak - base),
                peak_extra_write_mib=round(written.peak - base),
                build_s=round(t1 - t0, 2), write_s=round(t2 - t1, 2))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--mode", choices=["on", "off"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(child(args)))
        return
    rows = []
    for mode in ("off", "on"):
        cmd = [sys.executable, __file__, "--mode", mode, "--dim", str(args.dim), "--layers",
               str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(line.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
