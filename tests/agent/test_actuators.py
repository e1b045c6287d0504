"""The actuator registry (``trainer_agent/control/actuators.py``) against the command registry, and the
control plane's handling of states no leader can send, in one process: a missing or unknown
actuator fails at import, a bad encoded state or a text that did not arrive is an agent error
(never an exception into the loop), and the multipliers of the optimizer's own values act only
inside the step."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import trainer_agent as ta
from trainer_agent.control import plane as control  # noqa: F401 - the check ran at this import
from trainer_agent.control.actuators import ACTUATORS, Actuator, actuator, check_actuators
from trainguard.protocol.commands import BY_NAME, REGISTRY, STATE_FIELDS, CommandSpec, DesiredState, encode_state


def test_every_command_the_agent_acts_on_has_exactly_one_actuator() -> None:
    check_actuators()
    assert set(ACTUATORS) == {c.name for c in REGISTRY if c.agent}
    assert "resume" not in ACTUATORS and not BY_NAME["resume"].agent


def test_a_command_without_an_actuator_is_named() -> None:
    fake = CommandSpec("fake_command", "a command nobody acts on", lambda d, p, ctx: None)
    with pytest.raises(TypeError, match="no actuator for fake_command"):
        check_actuators((*REGISTRY, fake))
    check_actuators((*REGISTRY, CommandSpec("fake_command", "not for the agent", lambda d, p, c: None, agent=False)))


def test_an_actuator_of_an_unknown_command_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ACTUATORS, "no_such_command", Actuator)
    with pytest.raises(TypeError, match="do not exist: no_such_command"):
        check_actuators()
    monkeypatch.delitem(ACTUATORS, "no_such_command")
    monkeypatch.setitem(ACTUATORS, "resume", Actuator)  # a command the agent does not act on
    with pytest.raises(TypeError, match="do not exist: resume"):
        check_actuators()


def test_a_second_actuator_for_a_command_is_refused() -> None:
    with pytest.raises(TypeError, match="'pause' has two actuators"):
        actuator("pause")(type("AnotherPause", (Actuator,), {}))
    assert ACTUATORS["pause"].__name__ == "Pause"


@pytest.mark.parametrize(("setup", "named"), [
    ("import trainguard.protocol.commands as c\n"
     "c.REGISTRY = (*c.REGISTRY, c.CommandSpec('fake_command', 'x', lambda d, p, ctx: None))", "fake_command"),
    ("import trainer_agent.control.actuators as a\na.ACTUATORS['bogus_command'] = a.Actuator", "bogus_command"),
])
def test_importing_the_control_plane_fails_on_a_mismatch(setup: str, named: str) -> None:
    code = f"{setup}\nimport trainer_agent.control.plane\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "TypeError: the agent's actuators do not match the command registry" in proc.stderr
    assert named in proc.stderr.splitlines()[-1]


def _attached(opt_factory=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    opt = opt_factory(model.parameters())
    agent = ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=None, skip_nonfinite=True))
    errors: list[tuple[str, str]] = []
    agent.control._on_error = lambda kind, exc: errors.append((kind, str(exc)))
    return model, opt, agent, errors


def _step(model: nn.Module, opt: torch.optim.Optimizer, agent, seed: int) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    agent.end_step(1.0)


def _index(name: str) -> int:
    return 1 + [f.name for f in STATE_FIELDS].index(name)


def test_a_state_no_leader_can_send_is_an_agent_error_and_not_applied() -> None:
    _, _, agent, errors = _attached()
    good = encode_state(DesiredState(generation=1, lr_scale=0.5))
    agent.control._apply(good[:-1], 1)  # a wrong length
    bad_choice = list(good)
    bad_choice[_index("accumulation_lr_rule")] = 7  # no such rule
    agent.control._apply(bad_choice, 1)
    bad_bound = list(good)
    bad_bound[_index("checkpoint_seq")] = -3
    agent.control._apply(bad_bound, 1)
    assert [k for k, _ in errors] == ["control_state"] * 3
    assert "no choice number 7" in errors[1][1] and "out of bounds" in errors[2][1]
    assert agent.control.applied_generation == 0 and agent.control.lr_scale == 1.0
    agent.control._apply(good, 1)  # and a good one after them is applied
    assert agent.control.applied_generation == 1 and agent.control.lr_scale == 0.5
    agent.close(1.0)


def test_a_text_that_did_not_arrive_keeps_its_command_and_applies_the_rest() -> None:
    model, opt, agent, errors = _attached()
    _step(model, opt, agent, 1)
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    # the key of a layer name this rank never got (one rank: no store to read it from)
    state = encode_state(DesiredState(generation=1, lr_scale=0.25, reset_optimizer_seq=1, reset_optimizer_layers="0."))
    agent.control._apply(state, 1)
    assert [k for k, _ in errors] == ["control_text"]
    assert agent.control.applied_generation == 1 and agent.control.lr_scale == 0.25
    applied = agent.control.applied
    assert applied.reset_optimizer_seq == 0 and applied.reset_optimizer_layers == ""
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momentum))
    # the same text from the leader's own proposal: the reset happens
    agent.control._channel.proposed_texts = {state[_index("reset_optimizer_layers")]: "0."}
    agent.control._apply(encode_state(DesiredState(generation=2, lr_scale=0.25, reset_optimizer_seq=1,
                                                   reset_optimizer_layers="0.")), 2)
    assert [p in opt.state for p in model.parameters()] == [False, False, True, True]
    assert agent.control.values()["trainguard_optimizer_resets_total"] == 1.0
    agent.close(1.0)


def test_momentum_and_weight_decay_scales_act_inside_the_step_only() -> None:
    model, opt, agent, errors = _attached()
    ref_model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    ref_model.load_state_dict(model.state_dict())
    _step(model, opt, agent, 1)
    # 0.9 x 2 is held at 0.999; weight decay off
    agent.control._set(DesiredState(generation=1, momentum_scale=2.0, weight_decay_scale=0.0), 1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    ref_model(x).square().mean().backward()
    ref_opt.step()
    ref_opt.zero_grad()
    ref_opt.param_groups[0].update(momentum=0.999, weight_decay=0.0)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append((o.param_groups[0]["momentum"], o.param_groups[0]["weight_decay"])))
    _step(model, opt, agent, 2)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    ref_model(x).square().mean().backward()
    ref_opt.step()
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(model.parameters(), ref_model.parameters()))
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["weight_decay"] == 0.01
    assert opt.state_dict()["param_groups"][0]["momentum"] == 0.9
    assert agent.control.values()["trainguard_momentum_scale"] == 2.0
    assert agent.control.values()["trainguard_weight_decay_scale"] == 0.0
    assert not errors
    agent.close(1.0)


def test_the_levels_survive_a_restart_and_a_malformed_state_changes_nothing() -> None:
    _, _, agent, _ = _attached()
    agent.control._set(DesiredState(generation=2, lr_scale=0.5, grad_clip_norm=1.5, momentum_scale=0.8,
                                    reset_optimizer_seq=3), 0)
    saved = agent.control.state_dict()
    assert {k: saved[k] for k in ("grad_clip_norm", "momentum_scale", "weight_decay_scale", "reset_optimizer_seq")} == {
        "grad_clip_norm": 1.5, "momentum_scale": 0.8, "weight_decay_scale": 1.0, "reset_optimizer_seq": 3}
    agent.close(1.0)
    _, _, agent, _ = _attached()
    before = agent.control.state_dict()
    with pytest.raises(ValueError, match="malformed trainguard control state: momentum_scale"):
        agent.control.load_state_dict({**saved, "momentum_scale": float("nan")})
    assert agent.control.state_dict() == before  # all or nothing
    agent.control.load_state_dict(saved)
    assert agent.control.state_dict() == saved and agent.control.applied_generation == 2
    applied = agent.control.applied  # what the leader would propose: the restored levels
    assert (applied.lr_scale, applied.grad_clip_norm, applied.momentum_scale, applied.reset_optimizer_seq) == (
        0.5, 1.5, 0.8, 3)
    agent.close(1.0)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.tanh(self.attn(x)))


class _Blocks(nn.Module):
    def __init__(self, wrap) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.blocks = nn.ModuleList([wrap(_Block()) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_an_optimizer_reset_by_layer_name_finds_the_layer_inside_wrapped_blocks() -> None:
    """Blocks under ``checkpoint_wrapper`` (and ``torch.compile``: the same rule for ``_orig_mod``):
    the layer metrics name ``blocks.1.mlp``, and a reset of that name drops exactly its state."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = _Blocks(checkpoint_wrapper)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=None, layer_depth=3, skip_nonfinite=True))
    try:
        assert "blocks.1.mlp" in agent.parts.params.layers
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(1.0)
        agent.control._set(DesiredState(generation=1, reset_optimizer_seq=1, reset_optimizer_layers="blocks.1.mlp"), 1)
        dropped = {n for n, p in model.named_parameters() if p not in opt.state}
        assert dropped == {"blocks.1._checkpoint_wrapped_module.mlp.weight", "blocks.1._checkpoint_wrapped_module.mlp.bias"}
        assert agent.control.values()["trainguard_optimizer_reset_parameters"] == 2.0
    finally:
        agent.close(1.0)
