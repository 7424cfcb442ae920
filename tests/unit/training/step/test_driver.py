"""tune_recipes.training.step.driver: the loop every recipe runs."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from tune_recipes.training.checkpointing.state import RecipeState
from tune_recipes.training.reporting.progress import StepReporter
from tune_recipes.training.step import driver as driver_mod
from tune_recipes.training.step.driver import StepDriver
from tune_recipes.training.step.normalization import NormalizationPath, StepLossNormalizer
from tune_recipes.training.step.optim import LRSchedule

pytestmark = pytest.mark.unit
IGNORE, V, D, S = -100, 7, 5, 6


class _Rows(torch.utils.data.Dataset):
    """Examples with a ragged number of unmasked labels (the first position never counts)."""

    def __init__(self, n=12, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, S, D, generator=g)
        self.labels = torch.randint(0, V, (n, S), generator=g)
        for i in range(n):
            self.labels[i, 2 + i % (S - 2):] = IGNORE

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.labels[i]}


class _Logger:
    def __init__(self):
        self.rows = []

    def log_dict(self, metrics, step):
        self.rows.append({"step": step, **{k: float(v) for k, v in metrics.items()}})

    def close(self):
        pass


class _Sampler(DistributedSampler):
    def __init__(self, ds):
        super().__init__(ds, num_replicas=1, rank=0, shuffle=False)
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)
        super().set_epoch(epoch)


def _driver(batch_size, ga, steps_per_epoch, epochs=1, epochs_run=0, lr=0.5, hooks=(),
            log_every=1, on_nonfinite="raise", clip=float("inf"), normalizer=None, reporter=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(D, V)
    ds = _Rows()
    loader = DataLoader(ds, batch_size=batch_size, sampler=_Sampler(ds), drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    logger = _Logger()
    state = RecipeState(seed=0, total_epochs=epochs, max_steps_per_epoch=None, epochs_run=epochs_run)
    d = StepDriver(
        normalizer=normalizer or StepLossNormalizer(ga), parameters=list(model.parameters()), optimizer=opt,
        lr_schedule=LRSchedule(None, opt, num_training_steps=10, last_epoch=-1),
        dataloader=loader, steps_per_epoch=steps_per_epoch, global_step=epochs_run * steps_per_epoch,
        state=state, reporter=reporter(logger) if reporter else StepReporter(logger, log_every),
        device=torch.device("cpu"),
        ignore_index=IGNORE, clip_grad_norm=clip, hooks=hooks, on_nonfinite=on_nonfinite,
    )
    return d, model, logger


def _loss(model, batch):
    logits = model(batch["x"])[:, :-1]
    return F.cross_entropy(logits.reshape(-1, V), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=IGNORE)


def _train(d, model, nan_at_step=None):
    seen = []
    for epoch in d.epochs():
        for step in epoch:
            for batch in step:
                seen.append((epoch.index, d.global_step, step.num_tokens))
                loss = _loss(model, batch)
                if d.global_step + 1 == nan_at_step:  # 1-based, as logged
                    loss = loss * float("nan")
                step.backward(loss)
            step.finish()
    return seen


def test_micro_batches_group_into_steps_and_epochs_stop_at_steps_per_epoch():
    d, model, logger = _driver(batch_size=2, ga=2, steps_per_epoch=2, epochs=2)
    seen = _train(d, model)
    # 2 epochs x 2 steps x 2 micro-batches; the 6th batch of each epoch is never drawn.
    assert [(e, s) for e, s, _ in seen] == [(0, 0), (0, 0), (0, 1), (0, 1),
                                            (1, 2), (1, 2), (1, 3), (1, 3)]
    assert d.dataloader.sampler.epochs == [0, 1]
    assert d.global_step == 4 and d.state.epochs_run == 2
    assert [r["step"] for r in logger.rows] == [1, 2, 3, 4]
    # Tokens counted on the CPU labels after the shift: example i has 1 + i % 4 of them.
    assert [n for *_, n in seen[:2]] == [1 + 2, 3 + 4]


def test_accumulated_steps_train_exactly_like_one_big_batch():
    big, big_model, big_log = _driver(batch_size=4, ga=1, steps_per_epoch=3)
    acc, acc_model, acc_log = _driver(batch_size=2, ga=2, steps_per_epoch=3)
    assert big.normalizer.path is NormalizationPath.SKIP
    assert acc.normalizer.path is NormalizationPath.RESCALE
    _train(big, big_model)
    _train(acc, acc_model)
    for a, b in zip(big_model.parameters(), acc_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(big_log.rows, acc_log.rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["valid_tokens"] == b["valid_tokens"]


def test_resumed_driver_starts_at_the_saved_epoch():
    d, model, logger = _driver(batch_size=2, ga=1, steps_per_epoch=2, epochs=3, epochs_run=2)
    seen = _train(d, model)
    assert {e for e, *_ in seen} == {2}
    assert [r["step"] for r in logger.rows] == [5, 6]


class _Hook:
    def __init__(self):
        self.calls = []

    def before_step(self, global_step):
        self.calls.append(global_step)

    def metrics(self):
        return {"hooked": len(self.calls)}


def test_hooks_run_before_each_step_and_add_metrics():
    hook = _Hook()
    d, model, logger = _driver(batch_size=2, ga=2, steps_per_epoch=3, hooks=[hook])
    _train(d, model)
    assert hook.calls == [0, 1, 2]
    assert [r["hooked"] for r in logger.rows] == [1, 2, 3]


def test_extras_are_logged_as_token_means():
    d, model, logger = _driver(batch_size=2, ga=2, steps_per_epoch=1)
    for epoch in d.epochs():
        for step in epoch:
            for batch in step:
                loss = _loss(model, batch)
                step.backward(loss, extras={"part": loss * 2})
            step.finish()
    row = logger.rows[0]
    assert row["part"] == pytest.approx(2 * row["loss"], rel=1e-6)


def test_loss_scaling_is_the_factor_backward_applies():
    for ga, expect_scaled in ((1, False), (2, True)):
        d, model, _ = _driver(batch_size=2, ga=ga, steps_per_epoch=1)
        for epoch in d.epochs():
            for step in epoch:
                for batch in step:
                    expected = float(step.num_tokens) if expect_scaled else 1.0
                    assert step.loss_scaling == expected
                    step.backward(_loss(model, batch))
                step.finish()


def test_forgetting_backward_or_finish_is_an_error():
    d, model, _ = _driver(batch_size=2, ga=1, steps_per_epoch=2)
    with pytest.raises(RuntimeError, match="without step.backward"):
        for epoch in d.epochs():
            for step in epoch:
                for batch in step:
                    pass
    d, model, _ = _driver(batch_size=2, ga=1, steps_per_epoch=2)
    with pytest.raises(RuntimeError, match="without step.finish"):
        for epoch in d.epochs():
            for step in epoch:
                for batch in step:
                    step.backward(_loss(model, batch))


def test_the_path_is_logged_once_at_startup(monkeypatch):
    lines = []
    monkeypatch.setattr(driver_mod.log, "info", lambda msg, *a: lines.append(msg % a))
    d, model, _ = _driver(batch_size=2, ga=1, steps_per_epoch=2)
    _train(d, model)
    assert len(lines) == 1 and lines[0].startswith("loss normalization: skip")


# ---------------------------------------------------------------- on_nonfinite
from tune_recipes.config import ConfigError  # noqa: E402
from tune_recipes.training.step.nonfinite import NonFiniteError  # noqa: E402


def test_a_nan_step_stops_the_run_and_names_epoch_step_and_batches():
    d, model, logger = _driver(batch_size=2, ga=2, steps_per_epoch=3, epochs=2)
    with pytest.raises(NonFiniteError, match=r"epoch 1, step 5 \(batches 2-3 of the epoch\)"):
        _train(d, model, nan_at_step=5)
    assert d.global_step == 5  # stopped at the bad step, not later


def test_the_flag_is_read_only_at_logged_steps_and_epoch_ends_but_names_the_first_bad_step(monkeypatch):
    d, model, logger = _driver(batch_size=2, ga=1, steps_per_epoch=5, log_every=10)
    reads = []
    real_check = d.guard.check
    monkeypatch.setattr(d.guard, "check", lambda: (reads.append(d.global_step), real_check()))
    # raise mode never turns the flag into a Python bool per step (that would sync).
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("host sync"))
    with pytest.raises(NonFiniteError, match=r"epoch 0, step 2 \(batch 1 of the epoch"):
        _train(d, model, nan_at_step=2)
    # Steps 3..5 ran; the one read of the flag was at the epoch end.
    assert d.global_step == 5 and reads == [5]


def test_with_a_lagging_reporter_the_flag_is_read_one_step_late_and_names_the_bad_step():
    from tune_recipes.training.reporting.progress import DeviceValues

    cpu = torch.device("cpu")
    # CUDA's reporter (rows one step late), with marks that read at once on the CPU.
    lagging = lambda log: StepReporter(log, 1, lag=True,  # noqa: E731
                                       mark=lambda v: DeviceValues(v, cpu, lagged=False))
    d, model, logger = _driver(batch_size=2, ga=1, steps_per_epoch=5, reporter=lagging)
    checked = []
    real_check = d.guard.check
    d.guard.check = lambda staged=None: (checked.append((d.global_step, staged and staged[1])),
                                         real_check(staged))
    with pytest.raises(NonFiniteError, match=r"epoch 0, step 2 \(batch 1 of the epoch"):
        _train(d, model, nan_at_step=2)
    # Step 2's flag was read after step 3 was queued (not at step 2 itself: that would wait
    # for the device to drain), and the run stopped there.
    assert d.global_step == 3 and checked == [(2, 1), (3, 2)]
    assert [r["step"] for r in logger.rows] == [1, 2, 3]  # rows up to the stop are still written


def _lagging(log):
    from tune_recipes.training.reporting.progress import DeviceValues

    cpu = torch.device("cpu")
    return StepReporter(log, 1, lag=True, mark=lambda v: DeviceValues(v, cpu, lagged=False))


def test_with_a_lagging_reporter_a_checkpoint_position_writes_the_waiting_row():
    d, model, logger = _driver(batch_size=2, ga=1, steps_per_epoch=5, reporter=_lagging)
    d.dataloader.state_dict = lambda: {}  # a plain DataLoader here; the recipes' is stateful
    for epoch in d.epochs():
        for step in epoch:
            for batch in step:
                step.backward(_loss(model, batch))
            step.finish()
            if d.global_step == 3:
                d.position()  # what a mid-epoch checkpoint calls before saving
                # The saved step's row is out before the save: a run killed now keeps it.
                assert [r["step"] for r in logger.rows] == [1, 2, 3]
                return
    pytest.fail("never reached step 3")


def test_with_a_lagging_reporter_validation_never_runs_on_a_bad_steps_weights():
    d, model, logger = _driver(batch_size=2, ga=1, steps_per_epoch=5, reporter=_lagging)
    ran = []
    d.validator = lambda: ran.append(d.global_step) or 1.0
    d.validator.due = lambda step: step == 2
    with pytest.raises(NonFiniteError, match="step 2"):
        _train(d, model, nan_at_step=2)
    assert ran == [] and d.global_step == 2


def test_a_staged_flag_covers_only_the_steps_before_it():
    from tune_recipes.training.step.nonfinite import NonFiniteGuard, is_finite

    guard = NonFiniteGuard()
    guard.record(is_finite(torch.tensor(1.0), None), 1, "step 1")
    staged = guard.stage(1, torch.device("cpu"))
    guard.record(is_finite(torch.tensor(float("nan")), None), 2, "step 2")
    guard.check(staged)  # step 1 was fine
    with pytest.raises(NonFiniteError, match="step 2"):
        guard.check()


def test_skip_drops_the_bad_update_and_counts_it():
    d, model, logger = _driver(batch_size=2, ga=2, steps_per_epoch=3, on_nonfinite="skip",
                               clip=None)
    _train(d, model, nan_at_step=3)
    assert [r["skipped_steps"] for r in logger.rows] == [0, 0, 1]
    assert d.global_step == 3 and d.guard.skipped_steps == 1
    for p in model.parameters():
        assert torch.isfinite(p).all()


def test_skip_of_the_only_step_leaves_the_weights_untouched():
    d, model, logger = _driver(batch_size=2, ga=1, steps_per_epoch=1, on_nonfinite="skip")
    before = [p.detach().clone() for p in model.parameters()]
    _train(d, model, nan_at_step=1)
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    assert logger.rows[0]["skipped_steps"] == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(clip=-1.0), "clip_grad_norm=-1.0 must be > 0"),
    (dict(clip=0), "clip_grad_norm=0 must be > 0"),
    (dict(clip="abc"), "clip_grad_norm='abc'"),
    (dict(on_nonfinite="ignore"), "on_nonfinite='ignore': expected one of raise, skip"),
])
def test_bad_nonfinite_settings_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _driver(batch_size=2, ga=1, steps_per_epoch=1, **kwargs)


@pytest.mark.parametrize("distributed", [False, True])
def test_skip_is_refused_wherever_the_optimizer_steps_in_backward(distributed):
    """on_nonfinite=skip cannot undo an optimizer step already taken inside backward: refused on
    one device and on several ranks alike (the distributed in-backward path was let through)."""
    normalizer = StepLossNormalizer(1, optimizer_in_bwd=True, distributed=distributed)
    assert normalizer.path.steps_in_backward
    with pytest.raises(ConfigError, match="on_nonfinite=skip needs to drop a step"):
        _driver(batch_size=2, ga=1, steps_per_epoch=1, on_nonfinite="skip", normalizer=normalizer)


@pytest.mark.parametrize("ga", [1, 2], ids=["skip", "rescale"])
def test_on_nonfinite_skip_drops_a_step_without_label_tokens_and_trains_on(ga, caplog):
    """With on_nonfinite=skip a step whose examples hold no label token (0/0) is skipped like
    a non-finite one, named in the warning: its update dropped (the optimizer does not step),
    its loss logged as NaN, counted in skipped_steps; the steps around it train as in a run of
    the same batches without it, so the data (and a checkpoint's resume) can stay as it is."""
    import logging
    import math

    d, model, logger = _driver(batch_size=2, ga=ga, steps_per_epoch=3, on_nonfinite="skip")
    per_step = 2 * ga
    d.dataloader.dataset.labels[per_step:2 * per_step] = IGNORE  # step 2's examples
    steps = []
    real_step = d.optimizer.step
    d.optimizer.step = lambda *a, **k: (steps.append(d.global_step + 1), real_step(*a, **k))[1]
    with caplog.at_level(logging.WARNING):
        _train(d, model)
    assert steps == [1, 3] and d.guard.skipped_steps == 1 and d.state.skipped_steps == 1
    losses = [r["loss"] for r in logger.rows]
    assert math.isnan(losses[1]) and not math.isnan(losses[0]) and not math.isnan(losses[2])
    assert [r["skipped_steps"] for r in logger.rows] == [0, 1, 1]
    assert f"skipped the update of epoch 0, step 2 (batch{'es 2-3' if ga == 2 else ' 1'} of the epoch): " \
           "no unmasked label token (on_nonfinite=skip; 1 skipped so far)" in caplog.text
    # The same run without the empty step's batches: the same weights, the same losses.
    ref, ref_model, ref_logger = _driver(batch_size=2, ga=ga, steps_per_epoch=2, on_nonfinite="skip")
    ds = ref.dataloader.dataset
    keep = list(range(per_step)) + list(range(2 * per_step, len(ds.x)))
    ds.x, ds.labels = ds.x[keep], ds.labels[keep]
    _train(ref, ref_model)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [r["loss"] for r in ref_logger.rows] == [losses[0], losses[2]]


@pytest.mark.parametrize("ga", [1, 2], ids=["skip", "rescale"])
def test_a_step_without_label_tokens_closes_the_bar_before_its_one_line(ga):
    """The error is raised at the micro-batch (skip) or at the step boundary (rescale); on both
    the reporter is stopped first, so the line does not land on the progress bar's."""
    stopped = []

    def reporter(logger):
        rep = StepReporter(logger)
        rep.stop_for_error = lambda: stopped.append(True)
        return rep

    d, model, _ = _driver(batch_size=2, ga=ga, steps_per_epoch=2, reporter=reporter)
    d.dataloader.dataset.labels[:] = IGNORE  # every example cut before its response
    with pytest.raises(ConfigError, match="no unmasked label token"):
        _train(d, model)
    assert stopped == [True]


class _BadAt(_Rows):
    """``_Rows`` whose example ``bad`` cannot be made into tokens (as ExampleErrorsNamed says)."""

    def __init__(self, bad):
        super().__init__()
        self.bad = bad

    def __getitem__(self, i):
        if i == self.bad:
            raise ConfigError(f"dataset: example {i} cannot be made into tokens")
        # tokens: what the resume fingerprint hashes
        return {**super().__getitem__(i), "tokens": self.labels[i]}


def _saving_driver(bad, ga=1, log_every=1, save_every=None, epochs=1, save=None):
    """A driver over a stateful loader whose example ``bad`` fails, recording each save at a
    data error: (epoch, global step, batches the saved loader state had yielded, weights)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = torch.nn.Linear(D, V)
    ds = _BadAt(bad)
    loader = StatefulDataLoader(ds, batch_size=1, sampler=_Sampler(ds), drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    saves = []

    def record(epoch, position):
        [entry] = position.ranks
        saves.append((epoch, position.global_step, entry[driver_mod.DATALOADER_STATE]["_num_yielded"],
                      [p.detach().clone() for p in model.parameters()], entry[driver_mod.DATA_SHAPE]))

    d = StepDriver(
        normalizer=StepLossNormalizer(ga), parameters=list(model.parameters()), optimizer=opt,
        lr_schedule=LRSchedule(None, opt, num_training_steps=10, last_epoch=-1),
        dataloader=loader, steps_per_epoch=len(ds) // ga, global_step=0,
        state=RecipeState(seed=0, total_epochs=epochs, max_steps_per_epoch=None, epochs_run=0),
        reporter=StepReporter(_Logger(), log_every), device=torch.device("cpu"), ignore_index=IGNORE,
        clip_grad_norm=float("inf"), save_every_n_steps=save_every, save_on_data_error=save or record)
    return d, model, saves


def _train_saving(d, model, nan_at_step=None, bad_from_epoch_1=None):
    """_train, with the recipe's mid-epoch saves counted as the driver sees them;
    ``bad_from_epoch_1``: the example that fails from the second epoch on."""
    for epoch in d.epochs():
        if epoch.index == 1 and bad_from_epoch_1 is not None:
            d.dataloader.dataset.bad = bad_from_epoch_1
        for step in epoch:
            for batch in step:
                loss = _loss(model, batch)
                if d.global_step + 1 == nan_at_step:
                    loss = loss * float("nan")
                step.backward(loss)
            step.finish()


@pytest.mark.parametrize("ga", [1, 2], ids=["skip", "rescale"])
def test_a_bad_example_mid_epoch_saves_the_steps_before_it_at_their_boundary(ga):
    """Example 5 fails: the steps finished before it (5 with GA 1; 2 with GA 2, whose third step
    had drawn example 4 when 5 failed) are saved once, as the last finished step's mid-epoch
    checkpoint (its loader state, the weights of that step: the half-accumulated step changed
    none), and the line says so."""
    d, model, saves = _saving_driver(bad=5, ga=ga)
    with pytest.raises(ConfigError) as raised:
        _train_saving(d, model)
    steps = 5 // ga
    assert str(raised.value).startswith("dataset: example 5 cannot be made into tokens. ")
    assert f"The training up to step {steps} is saved as step_{steps}/" in str(raised.value)
    assert [(e, g, n) for e, g, n, _, _ in saves] == [(0, steps, steps * ga)]
    assert saves[0][4][driver_mod.DATASET_EXAMPLES] is not None  # the fingerprint, as position()
    assert driver_mod.DATASET_EXAMPLES_SKIPPED not in saves[0][4]  # example 5 is not hashed
    ref, ref_model, _ = _saving_driver(bad=None, ga=ga)
    ref.steps_per_epoch = steps
    _train_saving(ref, ref_model)
    for saved, trained in zip(saves[0][3], ref_model.parameters()):
        torch.testing.assert_close(saved, trained, rtol=0, atol=0)


def test_a_distributed_run_neither_saves_at_a_data_error_nor_snapshots_each_step(monkeypatch):
    """On several ranks a bad example stops the run without a save (the others are inside the
    step's collectives; a save is one), and no step pays for the host snapshot a save needs."""
    with monkeypatch.context() as m:  # two ranks when the driver is built (where it decides)
        m.setattr(driver_mod.dist, "is_available", lambda: True)
        m.setattr(driver_mod.dist, "is_initialized", lambda: True)
        m.setattr(driver_mod.dist, "get_world_size", lambda *a: 2)
        d, model, saves = _saving_driver(bad=5)
    snapshots = []
    monkeypatch.setattr(d, "_rank_entry", lambda: snapshots.append(1) or {})
    with pytest.raises(ConfigError) as raised:
        _train_saving(d, model)
    assert str(raised.value).startswith("dataset: example 5 cannot be made into tokens")
    assert "saved" not in str(raised.value) and saves == [] and snapshots == []


def test_nothing_new_to_keep_saves_nothing_and_says_where_the_newest_checkpoint_stands():
    """No step finished since the run's start (the line unchanged), or since the recipe's last
    mid-epoch save (save_every_n_steps=4, example 4 failing in step 5: the line says step 4 is
    in the newest checkpoint): no save."""
    for bad, save_every, said in ((0, None, ""),
                                  (4, 4, ". The training up to step 4 is in output_dir's newest checkpoint")):
        d, model, saves = _saving_driver(bad=bad, save_every=save_every)
        with pytest.raises(ConfigError) as raised:
            _train_saving(d, model)
        assert str(raised.value).startswith(f"dataset: example {bad} cannot be made into tokens{said}")
        assert saves == []


def test_a_run_with_a_non_finite_step_saves_nothing_at_a_data_error():
    """Step 2's loss is NaN, not read yet (logged every 10 steps) when example 4 fails: the
    weights it made are never checkpointed, and the NaN step is the line (fixing the data
    alone would meet it again)."""
    d, model, saves = _saving_driver(bad=4, log_every=10)
    with pytest.raises(NonFiniteError, match="step 2"):
        _train_saving(d, model, nan_at_step=2)
    assert saves == []


def test_a_bad_example_the_fingerprint_reads_is_left_out_of_it_and_named():
    """The last example (one of those hashed to tell a resume's data from other data) fails:
    the save's fingerprint leaves it out and names it, so the file with that row fixed in place
    matches (hashed leaving out the same example) and other examples of the same count do not."""
    d, model, saves = _saving_driver(bad=11)
    with pytest.raises(ConfigError, match="The training up to step 11 is saved"):
        _train_saving(d, model)
    [(_, step, _, _, shape)] = saves
    assert step == 11 and shape[driver_mod.DATASET_EXAMPLES_SKIPPED] == [11]
    assert shape["dataset_size"] == 12 and shape["batch_size"] == 1
    fixed = _BadAt(None)
    assert driver_mod.dataset_examples_fingerprint(fixed, skip=[11]) == (
        shape[driver_mod.DATASET_EXAMPLES], [11])
    assert driver_mod.dataset_examples_fingerprint(fixed)[0] != shape[driver_mod.DATASET_EXAMPLES]
    other = _BadAt(None)
    other.labels = _Rows(seed=1).labels
    assert driver_mod.dataset_examples_fingerprint(other, skip=[11])[0] != shape[driver_mod.DATASET_EXAMPLES]


def test_a_bad_example_in_a_later_epoch_saves_only_that_epochs_steps():
    """Example 3 fails in the second epoch: its 3 steps after epoch 0's checkpoint (step 12)
    are saved as step 15 of epoch 1. Example 0 failing there saves nothing: epoch 0's
    checkpoint already holds step 12 (its last step's boundary is not this epoch's)."""
    d, model, saves = _saving_driver(bad=None, epochs=2)
    with pytest.raises(ConfigError, match="The training up to step 15 is saved as step_15/"):
        _train_saving(d, model, bad_from_epoch_1=3)
    assert [(e, g, n) for e, g, n, _, _ in saves] == [(1, 15, 3)]
    d, model, saves = _saving_driver(bad=None, epochs=2)
    with pytest.raises(ConfigError, match="example 0 cannot be made into tokens. The training up "
                                          "to step 12 is in output_dir's newest checkpoint"):
        _train_saving(d, model, bad_from_epoch_1=0)
    assert saves == []


def test_a_save_that_fails_leaves_the_data_error_as_the_line():
    def full_disk(epoch, position):
        raise OSError(28, "No space left on device")

    d, model, _ = _saving_driver(bad=5, save=full_disk)
    with pytest.raises(ConfigError) as raised:
        _train_saving(d, model)
    assert str(raised.value) == ("dataset: example 5 cannot be made into tokens (saving the training "
                                 "up to step 5 first failed: [Errno 28] No space left on device)")
