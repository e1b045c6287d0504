"""trainer_agent/integrations/hf.py with a real ``transformers.Trainer`` (a tiny GPT-2 built from
a config, in-memory token data, CPU): trainguard's loss and grad norm equal what the Trainer logs,
with and without gradient accumulation; an operator's lr-scale, pause, checkpoint and stop through
a real controller process act on the run, and the Trainer's logs carry the LR the optimizer applied."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import trainer_agent as ta  # noqa: E402
from tests.control.procs import ControllerProcess, until  # noqa: E402
from trainer_agent.integrations.hf import TrainguardCallback  # noqa: E402

VOCAB, SEQ = 64, 16


class _Tokens(torch.utils.data.Dataset):
    """Fixed-length token sequences, labels = inputs (causal LM)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ))


def _args(tmp_path: Path, accumulation: int, max_steps: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
        max_steps=max_steps, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=0, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )


class _Record(TrainerCallback):
    """After trainguard's callback: trainguard's values at each step end, the Trainer's logs, and
    the LR the optimizer applied at each step (a pre-step hook registered after the agent's)."""

    def __init__(self, guard: TrainguardCallback) -> None:
        self.guard = guard
        self.ours: dict[int, dict[str, float]] = {}
        self.logged: dict[int, dict[str, float]] = {}
        self.applied_lr: list[float] = []
        self.schedule_lr: list[float] = []
        self.on_step: list = []

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):  # type: ignore[no-untyped-def]
        real = self.guard.agent.optimizer
        assert real is not optimizer and optimizer.optimizer is real  # the AcceleratedOptimizer's inner one

        def hook(opt, a, k):  # type: ignore[no-untyped-def]
            self.applied_lr.append(opt.param_groups[0]["lr"])
            self.schedule_lr.append(lr_scheduler.get_last_lr()[0])

        real.register_step_pre_hook(hook)

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.ours[state.global_step] = self.guard.agent.latest()
        for action in self.on_step:
            action(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            self.logged[state.global_step] = dict(logs)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_loss_and_grad_norm_equal_the_trainers_logs(tmp_path: Path, accumulation: int) -> None:
    guard = TrainguardCallback(job="hf-job", run=f"hf-acc{accumulation}",
                               config=ta.AgentConfig(metrics_port=None, report_every=1))
    record = _Record(guard)
    steps = 5
    trainer = Trainer(model=_model(), args=_args(tmp_path, accumulation, steps), train_dataset=_Tokens(64),
                      callbacks=[guard, record])
    trainer.train()
    assert sorted(record.logged) == sorted(record.ours) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        ours, logged = record.ours[step], record.logged[step]
        assert ours["trainguard_step"] == step
        assert ours["trainguard_loss"] == pytest.approx(logged["loss"], rel=1e-7), step
        assert ours["trainguard_grad_norm"] == pytest.approx(logged["grad_norm"], rel=1e-5), step
        # 2 sequences of SEQ tokens per micro-batch
        if step == 1:  # the warm-up step (its time is the warm-up's): no step time nor throughput
            assert "trainguard_tokens_per_second" not in ours
        else:
            assert ours["trainguard_tokens_per_second"] * ours["trainguard_step_duration_seconds"] == pytest.approx(
                2 * SEQ * accumulation)
    assert guard.agent.latest()["trainguard_agent_errors_total"] == 0.0
    assert guard.agent._closed and "training_step" not in vars(trainer)  # closed at train end, unwrapped
    assert "log" not in vars(trainer)
    # without a controller lr_scale is 1: the applied LR is the scheduler's, in the Trainer's own
    # history (what report_to integrations get) as well
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(history) == steps
    for h in history:
        assert h["trainguard/applied_lr"] == h["learning_rate"] and h["trainguard/lr_scale"] == 1.0


def test_a_resumed_train_goes_on_from_the_checkpoints_step(tmp_path: Path) -> None:
    def train(max_steps: int, resume: str | None = None) -> tuple[TrainguardCallback, _Record, Trainer]:
        guard = TrainguardCallback(job="hf-job", run="hf-resume",
                                   config=ta.AgentConfig(metrics_port=None, report_every=1))
        record = _Record(guard)
        args = _args(tmp_path, 1, max_steps)
        args.save_strategy, args.save_steps = "steps", 3
        trainer = Trainer(model=_model(), args=args, train_dataset=_Tokens(64), callbacks=[guard, record])
        trainer.train(resume_from_checkpoint=resume)
        return guard, record, trainer

    guard, _, _ = train(3)
    assert (tmp_path / "out" / "checkpoint-3" / "trainguard_agent.pt").is_file() and guard.agent.step == 3
    guard, record, trainer = train(5, str(tmp_path / "out" / "checkpoint-3"))
    assert trainer.state.global_step == 5 and guard.agent.step == 5
    assert sorted(record.ours) == [4, 5] and [record.ours[s]["trainguard_step"] for s in (4, 5)] == [4.0, 5.0]


class _Interrupt(TrainerCallback):
    """Raises KeyboardInterrupt out of ``train()`` at the end of step 2, once (a Ctrl-C)."""

    def __init__(self) -> None:
        self.armed = True

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.armed and state.global_step == 2:
            self.armed = False
            raise KeyboardInterrupt


@pytest.mark.parametrize("closed_by_user", [False, True])
def test_a_train_after_one_that_raised_reports_the_trainers_values(tmp_path: Path, closed_by_user: bool) -> None:
    guard = TrainguardCallback(job="hf-job", run="hf-retry", config=ta.AgentConfig(metrics_port=None, report_every=1))
    record = _Record(guard)
    trainer = Trainer(model=_model(), args=_args(tmp_path, 2, 3), train_dataset=_Tokens(64),
                      callbacks=[guard, record, _Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    first = guard.agent
    if closed_by_user:  # the module docstring's finally
        first.close()
    record.ours.clear()
    record.logged.clear()
    trainer.train()  # the Trainer starts again from step 1
    assert guard.agent is not first and first._closed
    assert sorted(record.logged) == sorted(record.ours) == [1, 2, 3]
    for step in (1, 2, 3):
        ours, logged = record.ours[step], record.logged[step]
        assert ours["trainguard_step"] == step
        assert ours["trainguard_loss"] == pytest.approx(logged["loss"], rel=1e-7), step
        assert ours["trainguard_grad_norm"] == pytest.approx(logged["grad_norm"], rel=1e-5), step
    assert "training_step" not in vars(trainer) and "log" not in vars(trainer)


@pytest.mark.integration
def test_operator_commands_act_on_the_trainer(tmp_path: Path) -> None:
    ctl = ControllerProcess(tmp_path / "trainguard.db").start()
    try:
        run = "hf-ops"
        guard = TrainguardCallback(job="hf-job", run=run,
                                   config=ta.AgentConfig(controller=ctl.url, metrics_port=None, report_every=1))
        record = _Record(guard)
        steps_seen_paused: list[int] = []

        def command(name: str, **body: object) -> None:
            generation = ctl.command(run, name, **body)["desired"]["generation"]
            assert until(lambda: (d := guard.agent.control.client.desired) is not None
                         and d.generation >= generation, 20.0)

        def resume_when_paused() -> None:
            assert until(lambda: guard.agent.control.paused, 30.0)
            steps_seen_paused.append(len(record.applied_lr))  # optimizer steps taken while it waits
            ctl.command(run, "resume")

        def operator(step: int) -> None:
            if step == 2:
                command("lr-scale", scale=0.5)  # applied at the end of step 3
            elif step == 4:
                threading.Thread(target=resume_when_paused, daemon=True).start()
                command("pause")  # applied at the end of step 5, which waits there for the resume
            elif step == 6:
                command("checkpoint")  # applied at step 7: checkpoint-7
            elif step == 8:
                command("stop")  # applied at step 9: the Trainer stops (and saves checkpoint-9)

        record.on_step.append(operator)
        max_steps = 20
        trainer = Trainer(model=_model(), args=_args(tmp_path, 2, max_steps), train_dataset=_Tokens(128),
                          callbacks=[guard, record])
        trainer.train()
        history = [(a.step, a.paused, a.lr_scale, a.stop) for a in guard.agent.control.history]
        assert history == [(3, False, 0.5, False), (5, True, 0.5, False), (5, False, 0.5, False),
                           (7, False, 0.5, False), (9, False, 0.5, True)]
        assert trainer.state.global_step == 9
        assert steps_seen_paused == [5]
        # the LR the optimizer applied: the scheduler's (linear decay from 1e-3, checked on its own
        # formula) times 0.5 from step 4 on
        assert len(record.applied_lr) == 9
        for k, (applied, scheduled) in enumerate(zip(record.applied_lr, record.schedule_lr), start=1):
            assert scheduled == pytest.approx(1e-3 * (max_steps - (k - 1)) / max_steps, rel=1e-12)
            assert applied == pytest.approx(scheduled * (0.5 if k >= 4 else 1.0), rel=1e-12), k
        # The Trainer logs its scheduler's LR for each step; trainguard's applied_lr beside it is the
        # LR that step's optimizer applied, lr_scale included, in the log history too.
        history = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
        assert sorted(record.logged) == list(range(1, 10))
        for step, logged in record.logged.items():
            assert history[step]["trainguard/applied_lr"] == logged["trainguard/applied_lr"]
            assert logged["learning_rate"] == pytest.approx(record.schedule_lr[step - 1], rel=1e-12)
            assert logged["trainguard/applied_lr"] == pytest.approx(record.applied_lr[step - 1], rel=1e-12), step
            assert logged["trainguard/lr_scale"] == (0.5 if step >= 4 else 1.0)
        assert record.logged[4]["trainguard/applied_lr"] == pytest.approx(0.5 * record.logged[4]["learning_rate"])
        saved = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
        assert saved == ["checkpoint-7", "checkpoint-9"]
        detail = ctl.run_detail(run)
        assert detail is not None and detail["status"] == "finished"
    finally:
        ctl.kill()


def _ddp_worker(rank: int, init: str, out: str) -> None:
    """One of 2 DDP ranks (gloo, CPU) in a process group this test starts; accelerate joins it."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group exists already: the port is unused
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    guard = TrainguardCallback(job="hf-job", run="hf-ddp", config=ta.AgentConfig(metrics_port=None, report_every=1))
    record = _Record(guard)
    args = _args(Path(out) / f"rank{rank}", 2, 4)
    args.ddp_backend = "gloo"
    trainer = Trainer(model=_model(), args=args, train_dataset=_Tokens(64), callbacks=[guard, record])
    trainer.train()
    torch.save({"ours": record.ours, "logged": record.logged}, f"{out}/rank{rank}.pt")


@pytest.mark.distributed
def test_ddp_rank_losses_average_to_the_trainers_logged_loss(tmp_path: Path) -> None:
    """Under DDP the Trainer scales each rank's loss by the world size (the token count is global)
    and logs the ranks' mean: each rank's trainguard loss is that rank's share, their mean the log."""
    from tests.control.spawn import spawn_ranks

    out = spawn_ranks(_ddp_worker, 2, tmp_path, timeout=240.0)
    logged = out[0]["logged"]
    assert sorted(logged) == sorted(out[1]["ours"]) == [1, 2, 3, 4]
    for step in range(1, 5):
        ours = [o["ours"][step] for o in out]
        assert sum(o["trainguard_loss"] for o in ours) / 2 == pytest.approx(logged[step]["loss"], rel=1e-6)
        assert ours[0]["trainguard_loss"] != ours[1]["trainguard_loss"]  # each rank its own data
        for o in ours:  # the all-reduced gradient: the same norm on both ranks
            assert o["trainguard_grad_norm"] == pytest.approx(logged[step]["grad_norm"], rel=1e-5)
