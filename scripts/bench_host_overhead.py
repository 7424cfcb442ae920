"""Host time of an eager forward + backward: a model of a real layout (layer count, heads, LoRA
placement) at tiny widths, where the kernels cost next to nothing and what is left is the host's
work per step (Python, dispatch, autograd, checkpointing's hooks). A proxy for eager steps of
small batches on a GPU, which wait on that work; run it on the CPU.

    python3 scripts/bench_host_overhead.py                 # Llama-3.1-8B LoRA's layout, 32 layers
    python3 scripts/bench_host_overhead.py --full --layers 28

Prints, for the model as torchtune builds it (activation checkpointing: none, or torch's
non-reentrant checkpoint as torchtune's recipes wrap layers) and as the single-device recipes
run it eagerly (``compile_or_lighten``'s RoPE; the reentrant checkpoint), the median host
milliseconds of a forward and backward over ``--reps`` steps and the aten
operators dispatched in one.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tune_recipes.training.setup.activations import apply_activation_checkpointing  # noqa: E402
from tune_recipes.training.setup.model import compile_or_lighten  # noqa: E402

# (label, activation checkpointing: None / "non-reentrant" / "reentrant", the recipes' eager RoPE)
MODES = [("torchtune's, no checkpointing", None, False),
         ("ours eager, no checkpointing", None, True),
         ("torchtune's, non-reentrant checkpoint", "non-reentrant", False),
         ("the reentrant checkpoint alone", "reentrant", False),
         ("ours eager, checkpointed (reentrant)", "reentrant", True)]


class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched inside the context (``.count``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def build(layers: int, full: bool, width: int) -> torch.nn.Module:
    """Llama-3.1-8B's layout (GQA 4:1, head dim 8 here, the shipped LoRA placement: q, v, output
    projections and the MLP, rank 8) at ``width``."""
    from torchtune.models.llama3_1._component_builders import llama3_1, lora_llama3_1
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    shape = dict(vocab_size=256, num_layers=layers, num_heads=width // 8, num_kv_heads=width // 32,
                 embed_dim=width, intermediate_dim=2 * width, max_seq_len=2048)
    torch.manual_seed(0)
    if full:
        return llama3_1(**shape)
    model = lora_llama3_1(lora_attn_modules=["q_proj", "v_proj", "output_proj"],
                          apply_lora_to_mlp=True, lora_rank=8, lora_alpha=16, **shape)
    set_trainable_params(model, get_adapter_params(model))
    return model


def measure(label: str, checkpoint, lighten: bool, args) -> dict:
    model = build(args.layers, args.full, args.width)
    if lighten:  # what the single-device setups do to an eager model
        compile_or_lighten(model, compile_model=False)
    if checkpoint:
        apply_activation_checkpointing(model, 1, reentrant=checkpoint == "reentrant")
    tokens = torch.randint(0, 256, (args.batch, args.tokens))

    def step():
        model(tokens).float().mean().backward()

    for _ in range(3):
        step()
    counter = CountOps()
    with counter:
        step()
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"mode": label, "host_ms": 1e3 * statistics.median(times), "aten_ops": counter.count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--full", action="store_true", help="a full fine-tune (every weight trains)")
    parser.add_argument("--width", type=int, default=64, help="embedding width (a multiple of 32)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a host thread's work, not the CPU's matmul throughput
    rows = [measure(*mode, args) for mode in MODES]
    print(f"{'full' if args.full else 'LoRA'}, {args.layers} layers, width {args.width}, "
          f"{args.batch} x {args.tokens} tokens, torch {torch.__version__}")
    print("| model | host ms a forward + backward | aten ops |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['host_ms']:.1f} | {row['aten_ops']} |")


if __name__ == "__main__":
    main()
