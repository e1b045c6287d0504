"""trainer_agent/integrations/lightning.py with a real Lightning ``Trainer`` (CPU, a tiny token
model): trainguard's loss and grad norm equal references the module computes itself, with and
without gradient accumulation (a short last window included); a NaN step under
``skip_nonfinite`` is skipped and training goes on; an operator's lr-scale, pause, checkpoint and
stop through a real controller process act on the run, and the loggers get the LR the optimizer
applied."""

from __future__ import annotations

import math
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")

import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.utilities import rank_zero_only  # noqa: E402

import trainer_agent as ta  # noqa: E402
from tests.control.procs import ControllerProcess, until  # noqa: E402
from trainer_agent.integrations.lightning import TrainguardCallback  # noqa: E402

VOCAB, SEQ, BATCH = 32, 8, 2


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


class _TinyLM(L.LightningModule):
    """Next-token prediction; records its own reference per optimizer step: the mean of its
    micro-batches' training_step losses and the float64 norm of the gradients the step uses."""

    def __init__(self, nan_at_step: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.out = nn.Linear(16, VOCAB)
        self.nan_at_step = nan_at_step
        self.micro: list[float] = []
        self.ref: dict[int, tuple[float, float]] = {}
        self.weights_before: list[torch.Tensor] = []
        self.unchanged: dict[int, bool] = {}

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        ids = batch["input_ids"]
        logits = self.out(self.emb(ids[:, :-1]))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        if self.nan_at_step is not None and self.global_step + 1 == self.nan_at_step:
            loss = loss * math.nan
        self.micro.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):  # type: ignore[no-untyped-def]
        norm = math.sqrt(sum(p.grad.double().square().sum().item() for p in self.parameters()))
        self.ref[self.global_step + 1] = (sum(self.micro) / len(self.micro), norm)
        self.micro = []
        self.weights_before = [p.detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        step = self.global_step
        if self.weights_before and step not in self.unchanged:
            self.unchanged[step] = all(torch.equal(a, p) for a, p in zip(self.weights_before, self.parameters()))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Record(L.Callback):
    """After trainguard's callback: trainguard's values at each optimizer step, and the LR the
    optimizer applied at each step (a pre-step hook registered after the agent's)."""

    def __init__(self, guard: TrainguardCallback) -> None:
        self.guard = guard
        self.ours: dict[int, dict[str, float]] = {}
        self.applied_lr: list[float] = []
        self.on_step: list = []

    def on_fit_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        real = trainer.optimizers[0]
        assert self.guard.agent.optimizer is real and pl_module.optimizers().optimizer is real
        real.register_step_pre_hook(lambda o, a, k: self.applied_lr.append(o.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        step = trainer.global_step
        if step and step not in self.ours:
            self.ours[step] = self.guard.agent.latest()
            for action in self.on_step:
                action(step)


class _MemoryLogger(Logger):
    """A Lightning logger keeping every ``log_metrics`` call: what W&B or TensorBoard would get."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs):  # type: ignore[no-untyped-def]
        pass

    @rank_zero_only
    def log_metrics(self, metrics, step=None):  # type: ignore[no-untyped-def]
        self.metrics.append(dict(metrics))


def _trainer(tmp_path: Path, callbacks: list, accumulation: int, logger: Logger | bool = False,
             **kw) -> L.Trainer:  # type: ignore[no-untyped-def]
    return L.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=accumulation, callbacks=callbacks,
                     enable_progress_bar=False, logger=logger, enable_checkpointing=False, enable_model_summary=False,
                     default_root_dir=str(tmp_path), num_sanity_val_steps=0, log_every_n_steps=1, **kw)


def _fit(trainer: L.Trainer, module: L.LightningModule, n: int) -> None:
    loader = torch.utils.data.DataLoader(_Tokens(n), batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, loader)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_loss_and_grad_norm_equal_the_modules_own_reference(tmp_path: Path, accumulation: int) -> None:
    guard = TrainguardCallback(job="pl-job", run=f"pl-acc{accumulation}",
                               config=ta.AgentConfig(metrics_port=None, report_every=1))
    record = _Record(guard)
    module = _TinyLM()
    # 10 micro-batches in one epoch: with accumulation 4 the windows are 4, 4 and 2
    _fit(_trainer(tmp_path, [guard, record], accumulation, max_epochs=1), module, 10 * BATCH)
    windows = [1] * 10 if accumulation == 1 else [4, 4, 2]
    assert sorted(record.ours) == sorted(module.ref) == list(range(1, len(windows) + 1))
    for step, window in enumerate(windows, start=1):
        ours, (ref_loss, ref_norm) = record.ours[step], module.ref[step]
        assert ours["trainguard_step"] == step
        assert ours["trainguard_loss"] == pytest.approx(ref_loss, rel=1e-6), step
        assert ours["trainguard_grad_norm"] == pytest.approx(ref_norm, rel=1e-5), step
        if step == 1:  # the warm-up step (its time is the warm-up's): no step time nor throughput
            assert "trainguard_tokens_per_second" not in ours
        else:
            assert ours["trainguard_tokens_per_second"] * ours["trainguard_step_duration_seconds"] == pytest.approx(
                BATCH * SEQ * window)
    latest = guard.agent.latest()
    assert latest["trainguard_agent_errors_total"] == 0.0 and latest["trainguard_nonfinite_steps_total"] == 0.0
    assert guard.agent._closed


def test_mixed_precision_with_a_grad_scaler_measures_the_unscaled_gradients(tmp_path: Path, caplog) -> None:
    # precision="16-mixed" on a GPU: Lightning's MixedPrecision plugin with a GradScaler, here the
    # same plugin with float16 autocast and a GradScaler on the CPU. The callback hands the agent
    # the plugin's scaler, so the norm (measured on the scaled gradients) is the unscaled one.
    from lightning.pytorch.plugins.precision import MixedPrecision

    guard = TrainguardCallback(job="pl-job", run="pl-amp", config=ta.AgentConfig(metrics_port=None, report_every=1))
    record = _Record(guard)
    module = _TinyLM()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    _fit(_trainer(tmp_path, [guard, record], 2, plugins=[plugin], max_steps=4), module, 8 * BATCH)
    assert guard.agent.scaler is plugin.scaler
    assert not [r for r in caplog.records if "not passed to attach" in r.getMessage()]  # passed, not found
    assert sorted(record.ours) == sorted(module.ref) == [1, 2, 3, 4]
    for step, ours in record.ours.items():
        assert ours["trainguard_grad_norm"] == pytest.approx(module.ref[step][1], rel=1e-5), step
        assert ours["trainguard_loss_scale"] == 2.0**10 and ours["trainguard_amp_skipped_steps_total"] == 0.0


class _ManualLM(_TinyLM):
    """Manual optimization as Lightning's docs write it: ``manual_backward`` of each micro-batch's
    loss divided by the micro-batches per step, an optimizer step after the last, no loss returned."""

    def __init__(self, accumulation: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.accumulation = accumulation

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        opt = self.optimizers()
        ids = batch["input_ids"]
        loss = nn.functional.cross_entropy(self.out(self.emb(ids[:, :-1])).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.micro.append(loss.item())
        self.manual_backward(loss / self.accumulation)
        if (batch_idx + 1) % self.accumulation == 0:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_manual_optimization_without_a_returned_loss_reports_each_step(tmp_path: Path, accumulation: int) -> None:
    # Under float16 mixed precision with a GradScaler: manual_backward is given the unscaled loss,
    # which the plugin scales before the backward pass; the reported loss is the unscaled one.
    from lightning.pytorch.plugins.precision import MixedPrecision

    guard = TrainguardCallback(job="pl-job", run="pl-manual", config=ta.AgentConfig(metrics_port=None, report_every=1))
    record = _Record(guard)
    module = _ManualLM(accumulation)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    trainer = _trainer(tmp_path, [guard, record], 1, plugins=[plugin], max_steps=4)
    _fit(trainer, module, 8 * accumulation * BATCH)
    assert trainer.global_step == 4 and guard.agent.step == 4
    assert sorted(record.ours) == sorted(module.ref) == [1, 2, 3, 4]
    for step, ours in record.ours.items():
        ref_loss, ref_norm = module.ref[step]  # the mean of the step's micro-batch losses
        assert ours["trainguard_step"] == step
        assert ours["trainguard_loss"] == pytest.approx(ref_loss, rel=1e-6), step
        assert ours["trainguard_grad_norm"] == pytest.approx(ref_norm, rel=1e-5), step
        if step == 1:  # the warm-up step (its time is the warm-up's): no step time nor throughput
            assert "trainguard_tokens_per_second" not in ours
        else:
            assert ours["trainguard_tokens_per_second"] * ours["trainguard_step_duration_seconds"] == pytest.approx(
                BATCH * SEQ * accumulation)
    assert guard.agent.latest()["trainguard_agent_errors_total"] == 0.0
    assert "manual_backward" not in vars(module)  # unwrapped at fit end


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_nan_step_is_skipped_and_training_goes_on(tmp_path: Path, accumulation: int) -> None:
    guard = TrainguardCallback(job="pl-job", run="pl-nan",
                               config=ta.AgentConfig(metrics_port=None, report_every=1, skip_nonfinite=True))
    record = _Record(guard)
    module = _TinyLM(nan_at_step=3)
    trainer = _trainer(tmp_path, [guard, record], accumulation, max_steps=6)
    _fit(trainer, module, 6 * accumulation * BATCH)
    assert trainer.global_step == 6
    assert module.unchanged == {1: False, 2: False, 3: True, 4: False, 5: False, 6: False}
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert math.isnan(module.ref[3][1]) and all(math.isfinite(module.ref[s][1]) for s in (1, 2, 4, 5, 6))
    assert math.isnan(record.ours[3]["trainguard_loss"])
    latest = guard.agent.latest()
    assert latest['trainguard_skipped_steps_total{reason="nonfinite"}'] == 1.0
    assert latest["trainguard_nonfinite_steps_total"] == 1.0
    assert latest["trainguard_agent_errors_total"] == 0.0


@pytest.mark.integration
def test_operator_commands_act_on_the_trainer(tmp_path: Path) -> None:
    ctl = ControllerProcess(tmp_path / "trainguard.db").start()
    try:
        run = "pl-ops"
        guard = TrainguardCallback(job="pl-job", run=run,
                                   config=ta.AgentConfig(controller=ctl.url, metrics_port=None, report_every=1))
        record = _Record(guard)
        steps_seen_paused: list[int] = []

        def command(name: str, **body: object) -> None:
            generation = ctl.command(run, name, **body)["desired"]["generation"]
            assert until(lambda: (d := guard.agent.control.client.desired) is not None
                         and d.generation >= generation, 20.0)

        def resume_when_paused() -> None:
            assert until(lambda: guard.agent.control.paused, 30.0)
            steps_seen_paused.append(len(record.applied_lr))
            ctl.command(run, "resume")

        def operator(step: int) -> None:
            if step == 2:
                command("lr-scale", scale=0.5)  # applied at the end of step 3
            elif step == 4:
                threading.Thread(target=resume_when_paused, daemon=True).start()
                command("pause")  # applied at the end of step 5, which waits there for the resume
            elif step == 6:
                command("checkpoint")  # applied at step 7
            elif step == 8:
                command("stop")  # applied at step 9: the Trainer stops (after a checkpoint)

        record.on_step.append(operator)
        logger = _MemoryLogger()
        trainer = _trainer(tmp_path, [guard, record], 2, logger=logger, max_steps=20)
        _fit(trainer, _TinyLM(), 40 * BATCH)
        history = [(a.step, a.paused, a.lr_scale, a.stop) for a in guard.agent.control.history]
        assert history == [(3, False, 0.5, False), (5, True, 0.5, False), (5, False, 0.5, False),
                           (7, False, 0.5, False), (9, False, 0.5, True)]
        assert trainer.global_step == 9
        assert steps_seen_paused == [5]
        assert len(record.applied_lr) == 9
        for k, applied in enumerate(record.applied_lr, start=1):
            scheduled = 0.1 / (1.0 + 0.1 * (k - 1))
            assert applied == pytest.approx(scheduled * (0.5 if k >= 4 else 1.0), rel=1e-12), k
        # The logger got, at the end of each optimizer step, the LR that step's optimizer applied
        # (the scheduler's LR x lr_scale): one entry per step.
        logged = [m for m in logger.metrics if "trainguard/applied_lr" in m]
        assert len(logged) == 9
        for step, m in enumerate(logged, start=1):
            assert m["trainguard/applied_lr"] == pytest.approx(record.applied_lr[step - 1], rel=1e-6), step
            assert m["trainguard/lr_scale"] == (0.5 if step >= 4 else 1.0)
        saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt"))
        assert saved == ["trainguard-step=7.ckpt", "trainguard-step=9.ckpt"]
        assert torch.load(tmp_path / "checkpoints" / "trainguard-step=7.ckpt", weights_only=False)["global_step"] == 7
        detail = ctl.run_detail(run)
        assert detail is not None and detail["status"] == "finished"
    finally:
        ctl.kill()


def _ddp_worker(rank: int, init: str, out: str) -> None:
    """One of 2 DDP ranks (gloo, CPU) in a process group this test starts; Lightning joins it."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    guard = TrainguardCallback(job="pl-job", run="pl-ddp",
                               config=ta.AgentConfig(metrics_port=None, report_every=1, skip_nonfinite=True))
    record = _Record(guard)
    module = _TinyLM(nan_at_step=3 if rank == 0 else None)  # non-finite gradients on rank 0 only
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", accumulate_grad_batches=2, max_steps=5,
                        callbacks=[guard, record], enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, default_root_dir=out)
    loader = torch.utils.data.DataLoader(_Tokens(40 * BATCH), batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    torch.save({"ours": record.ours, "ref": module.ref, "unchanged": module.unchanged,
                "weights": [p.detach().clone() for p in module.parameters()], "latest": guard.agent.latest(),
                "global_step": trainer.global_step}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_ddp_ranks_skip_the_same_nonfinite_step(tmp_path: Path) -> None:
    from tests.control.spawn import spawn_ranks

    out = spawn_ranks(_ddp_worker, 2, tmp_path, timeout=240.0)
    for o in out:
        assert o["global_step"] == 5
        assert o["unchanged"] == {1: False, 2: False, 3: True, 4: False, 5: False}  # both ranks skipped 3
        assert o["latest"]['trainguard_skipped_steps_total{reason="nonfinite"}'] == 1.0
        assert o["latest"]["trainguard_agent_errors_total"] == 0.0
        assert all(torch.isfinite(w).all() for w in o["weights"])
        for step in (1, 2, 4, 5):  # the rank's own loss; the gradient norm after DDP's all-reduce
            ref_loss, ref_norm = o["ref"][step]
            assert o["ours"][step]["trainguard_loss"] == pytest.approx(ref_loss, rel=1e-6)
            assert o["ours"][step]["trainguard_grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(out[0]["weights"], out[1]["weights"]))
    assert math.isnan(out[0]["ours"][3]["trainguard_loss"]) and math.isfinite(out[1]["ours"][3]["trainguard_loss"])


class _MeterNorms(L.Callback):
    """The agent's gradient norm of each optimizer step, read in a post-step hook (Lightning's
    closure runs the last backward pass inside ``optimizer.step``), on every step, report step
    or not."""

    def __init__(self, guard: TrainguardCallback) -> None:
        self.guard = guard
        self.norms: list[float] = []

    def on_fit_start(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        meter = self.guard.agent.parts.meter
        trainer.optimizers[0].register_step_post_hook(lambda o, a, k: self.norms.append(float(meter.grad_norm)))


def _bucket_view_worker(rank: int, init: str, out: str) -> None:
    """One of 2 DDP ranks under ``DDPStrategy(gradient_as_bucket_view=True)``, accumulating 2
    micro-batches (Lightning's ``no_sync``), a report every 3 steps."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    guard = TrainguardCallback(job="pl-job", run="pl-buckets", config=ta.AgentConfig(metrics_port=None, report_every=3))
    norms = _MeterNorms(guard)
    module = _TinyLM()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(gradient_as_bucket_view=True),
                        accumulate_grad_batches=2, max_steps=9, callbacks=[guard, norms], enable_progress_bar=False,
                        logger=False, enable_checkpointing=False, enable_model_summary=False, default_root_dir=out)
    loader = torch.utils.data.DataLoader(_Tokens(40 * BATCH), batch_size=BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    views = guard.agent.parts.params.bucket_views
    torch.save({"norms": norms.norms, "ref": module.ref, "used": None if views is None else views.used,
                "errors": guard.agent.latest()["trainguard_agent_errors_total"]}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_ddp_with_gradient_bucket_views_takes_the_norm_from_the_buckets(tmp_path: Path) -> None:
    """With ``DDPStrategy(gradient_as_bucket_view=True)`` the callback hands the agent the strategy's
    DDP wrapper: the ordinary steps' gradient norm comes from DDP's buckets, and on every step it
    equals the module's own float64 norm of the gradients its optimizer uses."""
    from tests.control.spawn import spawn_ranks

    for o in spawn_ranks(_bucket_view_worker, 2, tmp_path, timeout=240.0):
        assert o["errors"] == 0.0
        assert len(o["norms"]) == 9
        for step, got in enumerate(o["norms"], start=1):
            assert got == pytest.approx(o["ref"][step][1], rel=1e-5), step
        # Found on report step 3, then used on the ordinary steps 4, 5, 7 and 8.
        assert o["used"] == 4


def test_a_resumed_fit_goes_on_from_the_checkpoints_step(tmp_path: Path) -> None:
    def fit(max_steps: int, ckpt_path: str | None = None) -> tuple[TrainguardCallback, _Record, L.Trainer]:
        guard = TrainguardCallback(job="pl-job", run="pl-resume",
                                   config=ta.AgentConfig(metrics_port=None, report_every=1, skip_nonfinite=True))
        record = _Record(guard)
        trainer = _trainer(tmp_path, [guard, record], 1, max_steps=max_steps)
        loader = torch.utils.data.DataLoader(_Tokens(20 * BATCH), batch_size=BATCH)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(_TinyLM(nan_at_step=2), loader, ckpt_path=ckpt_path)
        return guard, record, trainer

    guard, _, trainer = fit(3)
    trainer.save_checkpoint(tmp_path / "three.ckpt")
    assert guard.agent.step == 3
    guard, record, trainer = fit(5, str(tmp_path / "three.ckpt"))
    assert trainer.global_step == 5 and guard.agent.step == 5
    assert [record.ours[s]["trainguard_step"] for s in (4, 5)] == [4.0, 5.0]
    latest = guard.agent.latest()
    assert latest['trainguard_skipped_steps_total{reason="nonfinite"}'] == 1.0  # step 2's skip, restored with the control state
    assert latest["trainguard_nonfinite_steps_total"] == 1.0


def test_a_fit_resumed_from_a_step_checkpoint_with_accumulation_ends_the_trainers_steps(tmp_path: Path) -> None:
    # Lightning restores global_step after on_fit_start: the resumed fit's first micro-batch (of 2)
    # is not the end of a step.
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=3, save_top_k=-1)
    guard = TrainguardCallback(job="pl-job", run="pl-resume-acc", config=ta.AgentConfig(metrics_port=None, report_every=1))
    _fit(L.Trainer(accelerator="cpu", devices=1, accumulate_grad_batches=2, max_steps=4, callbacks=[guard, checkpoints],
                   enable_progress_bar=False, logger=False, enable_model_summary=False, default_root_dir=str(tmp_path)),
         _TinyLM(), 20 * BATCH)
    guard = TrainguardCallback(job="pl-job", run="pl-resume-acc", config=ta.AgentConfig(metrics_port=None, report_every=1))
    record = _Record(guard)
    module = _TinyLM()
    trainer = _trainer(tmp_path, [guard, record], 2, max_steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(_Tokens(20 * BATCH), batch_size=BATCH),
                    ckpt_path=str(tmp_path / "ck" / "epoch=0-step=3.ckpt"))
    assert trainer.global_step == 6 and guard.agent.step == 6
    assert sorted(module.ref) == [4, 5, 6]
    for step in (4, 5, 6):
        ours, (ref_loss, ref_norm) = record.ours[step], module.ref[step]
        assert ours["trainguard_step"] == step
        assert ours["trainguard_loss"] == pytest.approx(ref_loss, rel=1e-6), step
        assert ours["trainguard_grad_norm"] == pytest.approx(ref_norm, rel=1e-5), step


class _SkippingLM(_TinyLM):
    """Returns None (Lightning's skip of a batch) for the batches in ``skip``."""

    def __init__(self, skip: tuple[int, ...]) -> None:
        super().__init__()
        self.skip = skip

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx in self.skip else loss

    def on_before_optimizer_step(self, optimizer):  # type: ignore[no-untyped-def]
        if all(p.grad is not None for p in self.parameters()):
            super().on_before_optimizer_step(optimizer)
        else:  # a skipped batch: Lightning steps the optimizer with no gradients
            self.micro = []


def test_skipped_batches_keep_the_agents_step_at_the_trainers(tmp_path: Path) -> None:
    guard = TrainguardCallback(job="pl-job", run="pl-skip", config=ta.AgentConfig(metrics_port=None, report_every=1))
    record = _Record(guard)
    module = _SkippingLM(skip=(2, 3, 4))
    trainer = _trainer(tmp_path, [guard, record], 1, max_steps=8)
    _fit(trainer, module, 12 * BATCH)
    assert trainer.global_step == 8 and guard.agent.step == 8
    assert {s: v["trainguard_step"] for s, v in record.ours.items()} == {s: float(s) for s in range(1, 9)}
    assert sorted(module.ref) == [1, 2, 6, 7, 8]  # the steps that had a loss
    for step in (1, 2, 6, 7, 8):
        assert record.ours[step]["trainguard_loss"] == pytest.approx(module.ref[step][0], rel=1e-6)
    for step in (3, 4, 5):  # no loss, no gradient: the report has neither (not step 2's, not 0)
        assert "trainguard_loss" not in record.ours[step] and "trainguard_grad_norm" not in record.ours[step]
    latest = guard.agent.latest()
    assert latest["trainguard_agent_errors_total"] == 0.0 and latest["trainguard_nonfinite_steps_total"] == 0.0


class _AppliedGradsLM(_TinyLM):
    """Keeps, per optimizer step, the gradients the step applies (float64): after Lightning's
    gradient clipping, which runs inside the closure after ``on_before_optimizer_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: dict[int, dict[str, torch.Tensor]] = {}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,  # type: ignore[no-untyped-def]
                                    gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.applied[self.global_step + 1] = {n: p.grad.double().clone() for n, p in self.named_parameters()}


@pytest.mark.parametrize(("accumulation", "clip"), [(1, None), (4, 0.05)])
def test_every_gradient_statistic_is_the_steps_own(tmp_path: Path, accumulation: int, clip: float | None) -> None:
    """Lightning's automatic optimization runs forward and backward inside ``optimizer.step(closure)``,
    after the optimizer's pre-step hook: each report's per-layer gradient statistics and largest
    |g| are those of the gradients its own step applies (they were the last step's, and absent at
    step 1); the gradient norm is the one before Lightning's clipping (``gradient_clip_val``)."""
    guard = TrainguardCallback(job="pl-job", run=f"pl-stats{accumulation}",
                               config=ta.AgentConfig(metrics_port=None, report_every=1, layer_depth=1))
    record = _Record(guard)
    module = _AppliedGradsLM()
    _fit(_trainer(tmp_path, [guard, record], accumulation, max_steps=4, gradient_clip_val=clip), module,
         4 * accumulation * BATCH)
    assert sorted(record.ours) == sorted(module.applied) == [1, 2, 3, 4]
    for step, grads in module.applied.items():
        ours = record.ours[step]
        assert ours["trainguard_grad_norm"] == pytest.approx(module.ref[step][1], rel=1e-5), step
        if clip is not None:  # clipped: the statistics below are not of the unclipped gradients
            assert math.sqrt(sum(float(g.square().sum()) for g in grads.values())) == pytest.approx(clip, rel=1e-4)
        every = torch.cat([g.reshape(-1) for g in grads.values()])
        assert ours["trainguard_grad_max_abs"] == pytest.approx(float(every.abs().max()), rel=1e-6), step
        for layer in ("emb", "out"):
            g = torch.cat([grads[n].reshape(-1) for n in grads if n.startswith(layer + ".")])
            ref = {"mean": g.mean(), "std": g.std(unbiased=False), "max_abs": g.abs().max(), "min_abs": g.abs().min()}
            for stat, want in ref.items():
                got = ours[f'trainguard_layer_grad_{stat}{{layer="{layer}"}}']
                assert got == pytest.approx(float(want), rel=1e-4, abs=1e-9), (step, layer, stat)
    assert guard.agent.latest()["trainguard_agent_errors_total"] == 0.0
