"""One compiled training step of Llama-3.2-1B (batch 4 x 2048) in bf16 vs torchao FP8, in one
process, no recipe around it: the FP8 lever alone at the real shape.

    python3 scripts/bench_fp8_step.py /tmp/fp8_step.txt

Model: torchtune's llama3_2_1b, default init, bf16; each layer compiled (torchtune's
compile_model, as the recipes do); chunked cross-entropy (8 chunks, compiled, as stock);
fused AdamW; random tokens. FP8: the filter of tune_recipes.training.setup.fp8 (the output head
and dims not multiples of 16 stay bf16), tensorwise, pad_inner_dim. Steps 4-11 timed between two
torch.cuda.synchronize() calls; peak = torch.cuda.max_memory_allocated.
(Run on 2026-11-30 as an inline copy of this code: the GPU run tool sent the session's main
checkout, so the branch's own module could not be imported there; the filter below is
should_convert's.)
"""

import dataclasses
import sys
import time

import torch
import torch.nn as nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchtune import training
from torchtune.models.llama3_2 import llama3_2_1b
from torchtune.modules.loss import CEWithChunkedOutputLoss


def filt(m, fqn):
    return (isinstance(m, nn.Linear) and fqn.split(".")[-1] != "output"
            and m.in_features % 16 == 0 and m.out_features % 16 == 0)


def bench(fp8, out, steps=11):
    torch.manual_seed(0)
    with torch.device("cuda"), training.set_default_dtype(torch.bfloat16):
        m = llama3_2_1b()
    if fp8:
        cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), pad_inner_dim=True)
        convert_to_float8_training(m, module_filter_fn=filt, config=cfg)
    training.compile_model(m, verbose=False)
    m.set_num_output_chunks(8)
    lf = CEWithChunkedOutputLoss()
    training.compile_loss(lf, verbose=False)
    opt = torch.optim.AdamW(m.parameters(), lr=2e-5, fused=True)
    tok = torch.randint(0, 128256, (4, 2049), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for i in range(steps):
        if i == 3:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = lf(m(tok[:, :-1]), tok[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / (steps - 3)
    r = (f"fp8={fp8} step {dt * 1e3:.1f} ms tok/s {8192 / dt:,.0f} "
         f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB loss {loss.item():.4f}")
    print(r, flush=True)
    with open(out, "a") as fh:
        fh.write(r + "\n")


if __name__ == "__main__":
    bench(False, sys.argv[1])
    bench(True, sys.argv[1])
