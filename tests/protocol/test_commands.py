"""The command registry: the desired state, the ranks' agreement codec and the actions metric
derive from each command's declaration."""

from __future__ import annotations

import math
import struct

import pytest
from pydantic import ValidationError

from trainguard.protocol import commands as c
from trainguard.protocol.commands import (
    BY_NAME, REGISTRY, STATE_FIELDS, STATE_INDEX, STATE_LAYOUT_VERSION, STATE_LEN, CommandRefused, DesiredState, action_names,
    apply_command, decode_state, encode_state, state_texts, text_key,
)

#: The agreement's layout as of STATE_LAYOUT_VERSION. A field added, removed or moved changes the
#: int64 every rank reads at each position: bump the version with the layout.
PINNED_LAYOUT = (4, (
    "generation", "paused", "checkpoint_seq", "stop", "stop_exit_code", "lr_scale", "rollback_seq", "rollback_step",
    "accumulation_steps", "accumulation_lr_rule", "memory_trace_seq", "verify_seq", "data_skip_until", "data_skip_from",
    "grad_clip_norm", "reset_optimizer_seq", "reset_optimizer_layers", "momentum_scale", "weight_decay_scale",
    "verify_float32_seq",
))


def test_the_agreement_layout_is_pinned_with_its_version() -> None:
    assert (STATE_LAYOUT_VERSION, ("generation", *(f.name for f in STATE_FIELDS))) == PINNED_LAYOUT
    assert STATE_LEN == len(PINNED_LAYOUT[1])
    assert STATE_INDEX == {name: i for i, name in enumerate(PINNED_LAYOUT[1]) if name != "generation"}


def test_the_desired_state_has_exactly_the_commands_fields() -> None:
    assert list(DesiredState.model_fields) == ["generation", *(f.name for f in STATE_FIELDS), "reason"]
    d = DesiredState()
    for f in STATE_FIELDS:
        assert getattr(d, f.name) == f.default


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def test_encoding_by_hand_and_back() -> None:
    d = DesiredState(generation=7, paused=True, checkpoint_seq=3, stop=True, stop_exit_code=75, lr_scale=0.25,
                     rollback_seq=2, rollback_step=90, accumulation_steps=8, accumulation_lr_rule="linear",
                     memory_trace_seq=1, verify_seq=4, data_skip_until=120, data_skip_from=113, grad_clip_norm=1.5,
                     reset_optimizer_seq=1, reset_optimizer_layers="layers.3.,head", momentum_scale=1.1, weight_decay_scale=0.0,
                     verify_float32_seq=5, reason="x")
    expected = [7, 1, 3, 1, 75, _bits(0.25), 2, 90, 8, 2, 1, 4, 120, 113, _bits(1.5), 1, text_key("layers.3.,head"),
                _bits(1.1), _bits(0.0), 5]
    assert encode_state(d) == expected
    assert state_texts(d) == {text_key("layers.3.,head"): "layers.3.,head"}
    back = decode_state(expected, state_texts(d))
    assert back == d.model_copy(update={"reason": ""})  # the reason is not agreed on (the leader logs it)


def test_a_text_key_is_never_zero_and_the_empty_text_is_zero() -> None:
    assert text_key("") == 0
    keys = {text_key(f"layer.{i}") for i in range(2000)}
    assert 0 not in keys and len(keys) == 2000 and all(0 < k < 2**63 for k in keys)


@pytest.mark.parametrize("broken, message", [
    (lambda v: v[:-1], "has 20 values"),
    (lambda v: v[:9] + [3] + v[10:], "no choice number 3"),  # accumulation_lr_rule
    (lambda v: v[:16] + [12345] + v[17:], "did not arrive"),  # reset_optimizer_layers
    (lambda v: v[:5] + [_bits(math.nan)] + v[6:], "out of bounds"),  # lr_scale NaN
    (lambda v: v[:4] + [999] + v[5:], "out of bounds"),  # stop_exit_code > 255
])
def test_states_no_leader_can_send_are_value_errors(broken, message) -> None:
    with pytest.raises(ValueError, match=message):
        decode_state(broken(encode_state(DesiredState())))


def test_action_names_follow_each_commands_fields() -> None:
    d = DesiredState()
    assert action_names(d, d.model_copy(update={"accumulation_steps": 4})) == ["accumulation"]
    assert action_names(d, d.model_copy(update={"paused": True, "grad_clip_norm": 2.0})) == ["pause", "grad_clip"]
    paused = d.model_copy(update={"paused": True, "stop": True})
    assert action_names(paused, d) == ["resume"]
    # The layers alone are not a new reset; a new sequence number is.
    assert action_names(d, d.model_copy(update={"reset_optimizer_layers": "a"})) == []
    assert action_names(d, d.model_copy(update={"reset_optimizer_seq": 1})) == ["reset_optimizer"]


class _Ctx:
    def __init__(self, target=None, why="no snapshot", skipped=0, healthy=None, own=None):
        self.target, self.why, self.skipped, self.healthy, self.own = target, why, skipped, healthy, own

    def own_accumulation(self):
        return self.own

    def rollback_target(self):
        return self.target, self.why

    def skipped_now(self):
        return self.skipped

    def healthy_median(self, metric):
        assert metric == "trainguard_grad_norm"
        return self.healthy


def test_scale_commands_take_a_scale_or_a_factor_clamped_to_their_bounds() -> None:
    d = DesiredState(momentum_scale=2.0)
    spec = BY_NAME["momentum"]
    assert apply_command(d, spec, spec.request(factor=8.0)) == ({"momentum_scale": c.MOMENTUM_SCALE_MAX}, "")
    assert apply_command(d, spec, spec.request(scale=0.5)) == ({"momentum_scale": 0.5}, "")
    assert apply_command(d, spec, spec.rule_action(factor=0.5, min=1.5)) == ({"momentum_scale": 1.5}, "")
    with pytest.raises(ValidationError, match="exactly one"):
        spec.request(scale=1.0, factor=2.0)
    with pytest.raises(ValidationError):
        BY_NAME["lr_scale"].request(scale=math.inf)
    with pytest.raises(ValidationError):
        BY_NAME["weight_decay_scale"].request(scale=-1.0)


def test_an_unchanged_value_is_no_update() -> None:
    assert apply_command(DesiredState(paused=True), BY_NAME["pause"], BY_NAME["pause"].request()) == ({}, "")
    assert apply_command(DesiredState(), BY_NAME["resume"], BY_NAME["resume"].request()) == ({}, "")


def test_rollback_refuses_an_operator_and_pauses_for_a_rule_without_a_snapshot() -> None:
    spec = BY_NAME["rollback"]
    with pytest.raises(CommandRefused, match="rollback refused: none kept"):
        apply_command(DesiredState(), spec, spec.request(), _Ctx(why="none kept"))
    assert apply_command(DesiredState(), spec, spec.rule_action(), _Ctx(why="none kept")) == (
        {"paused": True}, "rollback refused: none kept; paused for a human")
    updates, note = apply_command(DesiredState(lr_scale=0.5), spec, spec.rule_action(lr_factor=0.5), _Ctx(target=40))
    assert updates == {"rollback_seq": 1, "rollback_step": 40, "lr_scale": 0.25}
    assert note == "rollback to the snapshot of step 40, lr_scale 0.25"
    assert apply_command(DesiredState(), spec, spec.rule_action(unless_skipped=True), _Ctx(target=40, skipped=2))[0] == {}


def test_grad_clip_by_value_or_from_the_healthy_norm() -> None:
    spec = BY_NAME["grad_clip"]
    assert apply_command(DesiredState(), spec, spec.request(max_norm=2.5))[0] == {"grad_clip_norm": 2.5}
    assert apply_command(DesiredState(grad_clip_norm=2.5), spec, spec.request(max_norm=0.0))[0] == {"grad_clip_norm": 0.0}
    updates, note = apply_command(DesiredState(), spec, spec.rule_action(factor=2.0), _Ctx(healthy=0.75))
    assert updates == {"grad_clip_norm": 1.5} and "2 x the healthy 0.75" in note
    for healthy in (None, math.nan, 0.0):
        assert apply_command(DesiredState(), spec, spec.rule_action(), _Ctx(healthy=healthy))[0] == {}


def test_accumulation_rule_multiplies_the_steps_in_force_or_the_runs_own() -> None:
    spec = BY_NAME["accumulation"]
    grow, shrink = spec.rule_action(factor=1.5, max_steps=16), spec.rule_action(factor=1 / 1.2, min_steps=2)
    # No command set the steps yet (0): the run's own 4 x 1.5 = 6, with the action's LR rule.
    assert apply_command(DesiredState(), spec, grow, _Ctx(own=4)) == (
        {"accumulation_steps": 6, "accumulation_lr_rule": "sqrt"},
        "accumulation steps 4 -> 6 (x1.5; the run's own 4, LR rule sqrt)")
    # The steps in force: 6 x 1.5 = 9; 9 x 1.5 = 13.5 rounds half up to 14; 14 x 1.5 = 21 is clamped to 16.
    assert apply_command(DesiredState(accumulation_steps=6, accumulation_lr_rule="sqrt"), spec, grow, _Ctx(own=4))[0] == {
        "accumulation_steps": 9}
    assert apply_command(DesiredState(accumulation_steps=9), spec, grow, _Ctx(own=4))[0]["accumulation_steps"] == 14
    assert apply_command(DesiredState(accumulation_steps=14), spec, grow, _Ctx(own=4))[0]["accumulation_steps"] == 16
    # At the bound: nothing changes and the note says so (no new generation follows).
    assert apply_command(DesiredState(accumulation_steps=16), spec, grow, _Ctx(own=4)) == (
        {}, "accumulation steps stay 16: at the bound 16")
    # Shrinking by 1.2x: 9 / 1.2 = 7.5 -> 8; 3 / 1.2 = 2.5 -> 3 would not move: one step down, to 2;
    # at min_steps it stays.
    assert apply_command(DesiredState(accumulation_steps=9), spec, shrink, _Ctx(own=4))[0]["accumulation_steps"] == 8
    assert apply_command(DesiredState(accumulation_steps=3), spec, shrink, _Ctx(own=4))[0]["accumulation_steps"] == 2
    assert apply_command(DesiredState(accumulation_steps=2), spec, shrink, _Ctx(own=4))[0] == {}
    # A run above max_steps on its own is not shrunk by a rule that grows.
    assert apply_command(DesiredState(), spec, grow, _Ctx(own=32)) == ({}, "accumulation steps stay 32: at the bound 16")
    # A paused or stopped run is a human's: left as it is.
    assert apply_command(DesiredState(paused=True), spec, grow, _Ctx(own=4)) == (
        {}, "no accumulation change: the run is paused")
    assert apply_command(DesiredState(stop=True), spec, grow, _Ctx(own=4))[0] == {}
    linear = spec.rule_action(factor=2.0, lr_rule="linear")
    assert apply_command(DesiredState(), spec, linear, _Ctx(own=1))[0] == {"accumulation_steps": 2, "accumulation_lr_rule": "linear"}


def test_accumulation_rule_leaves_a_run_that_did_not_opt_in_as_it_is() -> None:
    spec = BY_NAME["accumulation"]
    note = "no accumulation change: the run did not opt in (attach the agent with accumulation_steps=N)"
    assert apply_command(DesiredState(), spec, spec.rule_action(factor=1.5), _Ctx(own=None)) == ({}, note)
    assert apply_command(DesiredState(), spec, spec.rule_action(factor=1.5)) == ({}, note)
    # The operator's body is unchanged: absolute steps and the rule.
    assert apply_command(DesiredState(), spec, spec.request(steps=8, lr_rule="linear"))[0] == {
        "accumulation_steps": 8, "accumulation_lr_rule": "linear"}


@pytest.mark.parametrize("bad, message", [
    ({"factor": 1.0}, "a factor of 1 changes nothing"),
    ({"factor": 1.5, "min_steps": 8, "max_steps": 4}, "min_steps must be <= max_steps"),
    ({"factor": 0.0}, "greater than 0"),
    ({"factor": math.nan}, "finite number"),
    ({"factor": 1.5, "max_steps": c.MAX_ACCUMULATION_STEPS + 1}, "less than or equal"),
    ({"factor": 1.5, "lr_rule": "cubic"}, "'none', 'sqrt' or 'linear'"),
    ({}, "factor"),
])
def test_accumulation_rule_action_validates(bad, message) -> None:
    with pytest.raises(ValidationError, match=message):
        BY_NAME["accumulation"].rule_action(**bad)


def test_reset_optimizer_names_its_layers() -> None:
    spec = BY_NAME["reset_optimizer"]
    updates, note = apply_command(DesiredState(), spec, spec.request(layers=["layers.3.", "head"]))
    assert updates == {"reset_optimizer_seq": 1, "reset_optimizer_layers": "layers.3.,head"}
    assert note == "optimizer state reset for the layers layers.3.,head"
    for bad in (["a,b"], [""], ["x" * 257], ["a\nb"]):
        with pytest.raises(ValidationError, match="layer name prefix"):
            spec.request(layers=bad)


def test_every_rule_action_is_named_after_its_command_and_every_url_is_unique() -> None:
    actions = {spec.name: spec.rule_action for spec in REGISTRY if spec.rule_action is not None}
    assert {name: a.model_fields["type"].default for name, a in actions.items()} == {name: name for name in actions}
    assert set(actions) == {"pause", "checkpoint", "stop", "lr_scale", "rollback", "accumulation", "memory_trace", "verify",
                            "verify_float32", "grad_clip", "reset_optimizer", "momentum", "weight_decay_scale"}
    assert len({s.url for s in REGISTRY}) == len(REGISTRY)


def test_a_data_skip_names_its_first_and_last_step() -> None:
    d = DesiredState(generation=3)
    changed, _ = apply_command(d, BY_NAME["data_skip"], c.DataSkipRequest(first=25, until=30))
    assert changed == {"data_skip_from": 25, "data_skip_until": 30}
    assert apply_command(d, BY_NAME["data_skip"], c.DataSkipRequest(until=30))[0] == {"data_skip_until": 30}
    with pytest.raises(ValidationError, match=r"first \(31\) is after until \(30\)"):
        c.DataSkipRequest(first=31, until=30)
