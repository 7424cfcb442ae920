"""Diagnostic (2026-12-01): which step of a lagged row waits for the GPU queue to drain."""
import torch
from tune_recipes.training.reporting.progress import DeviceValues, warm_pinned_cache, StepReporter

dev = torch.device("cuda")
warm_pinned_cache()
def chk(what, step):
    e = torch.cuda.Event(); e.record()
    print(f"step {step} {what:28s} drained={e.query()}", flush=True)
start = DeviceValues({}, dev, lagged=True)
prev = None
for step in range(1, 5):
    torch.cuda._sleep(100_000_000)
    loss = torch.full((), float(step), device="cuda")
    chk("after sleep+full", step)
    if prev is not None:
        prev.values(); chk("after prev.values()", step)
        prev.seconds_since(start); chk("after prev.seconds_since", step)
        start = prev
    g = loss * 2
    chk("after loss*2", step)
    prev = DeviceValues({"loss": loss, "grad_norm": g}, dev, lagged=True)
    chk("after DeviceValues", step)
class L:
    rows = []
    def log_dict(self, m, step): print("row", step, m, flush=True)
    def close(self): pass
rep = StepReporter(L(), device=dev)
print("lags", rep.lags)
rep.start_epoch(0, 1, 4)
for step in range(1, 5):
    torch.cuda._sleep(100_000_000)
    loss = torch.full((), float(step), device="cuda")
    rep.add_tokens(100)
    rep.step_done(step, loss, lr=0.0, grad_norm=loss * 2)
    chk("after step_done", step)
rep.end_epoch()
