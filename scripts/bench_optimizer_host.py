"""Host time of an optimizer step taken one parameter at a time, as ``optimizer_in_bwd`` takes it,
or (``--after-backward``) of one optimizer over every parameter, as the recipes step it after
backward.

Stepped inside backward, each parameter's ``optimizer.step()`` is host work the GPU waits for
between gradient kernels: an optimizer whose per-call host cost is high slows the whole step even
when its kernels are fast. This builds the parameters of a torchtune model's real shapes (random
bf16 values, random gradients), one optimizer per parameter, and times a pass over them: the host
time of the pass (no synchronize inside it) and the pass synchronized at its end. With
``--after-backward`` one optimizer holds them all, built by the recipes' own ``build_optimizer``;
``--compiled`` builds it as ``compile_optimizer_step: True`` does (torch's Adam/AdamW through
``CompiledOptimizerStep``, ``tune_recipes.optim.AdamW8bit`` in one graph a step). Each optimizer
runs ``--passes`` times, alternated, after ``--warmup`` untimed steps (torch.compile's first calls);
the median of ``--steps`` timed steps is reported. The optimizers share one process, so one
may find graphs another compiled in torch.compile's caches: the warm-up steps take that cost.

    python3 scripts/bench_optimizer_host.py --model torchtune.models.llama3_2.llama3_2_3b \
        --optimizers torchao.optim.AdamW8bit,tune_recipes.optim.AdamW8bit --device cuda
    python3 scripts/bench_optimizer_host.py --model torchtune.models.llama3_2.llama3_2_1b \
        --optimizers torch.optim.AdamW,tune_recipes.optim.AdamW8bit --after-backward --compiled

Prints one line per optimizer and pass; ``--out FILE`` also writes them as JSON.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tune_recipes.config import ConfigError, resolve_component


def component(flag: str, path: str):
    """The class or function at a dotted path, or exit naming the flag and the path."""
    try:
        return resolve_component(path, flag.lstrip("-"))
    except ConfigError as e:
        reason = str(e).split(": ", 1)[-1]  # without the config key resolve_component names
        raise SystemExit(f"{flag} {path}: cannot import it ({reason})") from None


def parameter_shapes(model_path: str) -> list:
    """The shapes of a torchtune model builder's parameters (tied ones once), built on meta."""
    builder = component("--model", model_path)
    try:
        with torch.device("meta"):
            model = builder()
        return [tuple(p.shape) for p in model.parameters()]
    except Exception as e:  # not a builder taking no arguments, or it built no module
        raise SystemExit(f"--model {model_path}: not a model builder that takes no arguments "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def time_optimizer(cls, shapes: list, device: str, warmup: int, steps: int, lr: float,
                   after_backward: bool = False, compiled: bool = False) -> dict:
    """Time ``cls`` (an optimizer class, built as ``cls([param], lr=lr)`` for each parameter, or
    ``after_backward`` once over them all by ``build_optimizer``) over ``shapes``."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02)
                               .to(device=device, dtype=torch.bfloat16))
        p.grad = (torch.randn(shape, generator=generator) * 1e-3).to(device=device,
                                                                     dtype=torch.bfloat16)
        params.append(p)
    if after_backward:
        from omegaconf import OmegaConf

        from tune_recipes.training.step.optim import build_optimizer

        holder = torch.nn.Module()
        holder.params = torch.nn.ParameterList(params)
        cfg = OmegaConf.create({"_component_": f"{cls.__module__}.{cls.__qualname__}", "lr": lr})
        optimizers = [build_optimizer(cfg, holder, compile_step=compiled)]
    else:
        optimizers = [cls([p], lr=lr) for p in params]  # one a parameter, as optimizer_in_bwd

    def synchronize():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def one_pass():
        for optimizer in optimizers:
            optimizer.step()

    first_step_s = None
    for i in range(warmup):
        start = time.perf_counter()
        one_pass()
        if i == 0:  # torch.compile's first call compiles: what a run pays once at its start
            synchronize()
            first_step_s = round(time.perf_counter() - start, 2)
    synchronize()
    host, synchronized = [], []
    for _ in range(steps):
        start = time.perf_counter()
        one_pass()
        launched = time.perf_counter()
        synchronize()
        done = time.perf_counter()
        host.append(launched - start)
        synchronized.append(done - start)
    return {"optimizer": f"{cls.__module__}.{cls.__qualname__}", "params": len(params),
            "mode": ("after backward, compiled" if compiled else "after backward")
            if after_backward else "in backward",
            "host_ms": round(statistics.median(host) * 1e3, 2),
            "synchronized_ms": round(statistics.median(synchronized) * 1e3, 2),
            "host_ms_per_param": round(statistics.median(host) * 1e3 / len(params), 4),
            "first_step_s": first_step_s}


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="torchtune.models.llama3_2.llama3_2_3b",
                        help="a torchtune model builder; its parameters' shapes are stepped")
    parser.add_argument("--optimizers",
                        default="torchao.optim.AdamW8bit,tune_recipes.optim.AdamW8bit",
                        help="comma-separated optimizer classes, each built as cls([param], lr=...)")
    parser.add_argument("--device", default="cuda",
                        help="where the parameters live (cpu: host time with the compute in it)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--after-backward", action="store_true",
                        help="one optimizer over every parameter (the recipes' default), not one each")
    parser.add_argument("--compiled", action="store_true",
                        help="with --after-backward: built as compile_optimizer_step: True builds it")
    parser.add_argument("--out", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.compiled and not args.after_backward:
        parser.error("--compiled: only with --after-backward (the in-backward step is not compiled)")
    for name in ("passes", "warmup", "steps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name} {getattr(args, name)}: expected at least "
                         f"{0 if name == 'warmup' else 1}")
    if not args.lr > 0:
        parser.error(f"--lr {args.lr}: expected a positive learning rate")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        parser.error(f"--out {args.out}: its folder does not exist (checked before measuring)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here (--device cpu, with a "
                     "small --model such as tune_recipes.models.tiny_llama3)")
    try:
        torch.empty(0, device=args.device)
    except Exception as e:  # an unknown device type, or a device index that is not there
        parser.error(f"--device {args.device}: {(str(e).splitlines() or [''])[0]}")
    optimizers = {name.strip(): component("--optimizers", name.strip())
                  for name in args.optimizers.split(",") if name.strip()}
    if not optimizers:
        parser.error(f"--optimizers {args.optimizers!r}: name at least one optimizer class")
    for name, cls in optimizers.items():
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            parser.error(f"--optimizers {name}: not a torch.optim.Optimizer class")
    shapes = parameter_shapes(args.model)
    rows = []
    for pass_index in range(args.passes):
        for optimizer_path, cls in optimizers.items():
            try:
                row = time_optimizer(cls, shapes, args.device, args.warmup, args.steps, args.lr,
                                     args.after_backward, args.compiled)
            except ConfigError as e:  # e.g. --compiled with an optimizer it does not compile
                raise SystemExit(f"--optimizers {optimizer_path}: {e}") from None
            row["optimizer"], row["pass"] = optimizer_path, pass_index
            rows.append(row)
            print(f"{optimizer_path} ({row['mode']}): {row['params']} parameters, host {row['host_ms']} ms a step "
                  f"(median), synchronized {row['synchronized_ms']} ms, "
                  f"{row['host_ms_per_param']} ms a parameter; first step {row['first_step_s']} s",
                  flush=True)
            if args.out:  # after every row: a run cut short keeps the rows before it
                with open(args.out, "w") as f:
                    json.dump({"model": args.model, "device": args.device,
                               "torch": torch.__version__, "rows": rows}, f, indent=1)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
