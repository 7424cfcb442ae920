"""Gradient rescale pass: multiply by a 0-dim CUDA tensor (torchtune's scale_grads) vs by a
Python float (ours), over Llama-3.2-1B-shaped bf16 gradients.

    python3 scripts/bench_scale_grads.py
"""

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchtune import training  # noqa: E402
from torchtune.models.llama3_2 import llama3_2_1b  # noqa: E402

from tune_recipes.training import scale_grads_  # noqa: E402


def timed(fn, iters=20):
    for _ in range(3):
        fn()
    out = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def main():
    with training.set_default_dtype(torch.bfloat16), torch.device("cuda"):
        model = llama3_2_1b()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    nbytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    num_tokens = torch.tensor(8192, device="cuda")
    t_tensor = timed(lambda: training.scale_grads(model, 1 / num_tokens))
    t_float = timed(lambda: scale_grads_(model.parameters(), 1 / 8192))
    rows = {"grad_bytes": nbytes,
            "torchtune scale_grads (0-dim CUDA tensor) ms": round(t_tensor, 3),
            "tune_recipes scale_grads_ (Python float) ms": round(t_float, 3),
            "tensor TB/s": round(2 * nbytes / t_tensor / 1e9, 2),
            "float TB/s": round(2 * nbytes / t_float / 1e9, 2),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps(rows, indent=1))
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
