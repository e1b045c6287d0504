"""The autograd engine's private members (``trainer_agent/compat/torch_hooks.py``), each exercised on
the real torch object: every test fails when its member is gone or no longer means what the agent
relies on (the adapter falls back quietly, so the tests also check that no fallback was taken)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer_agent import compat
from trainer_agent.compat import torch_hooks as th


pytestmark = pytest.mark.usefixtures("no_adapter_fallback")


def test_queued_callback_runs_once_at_the_end_of_backward():
    """Queued from the first gradient hook, the callback runs after every other gradient is done
    (the last layer's gradient arrives first, the first layer's last), once, before backward returns."""
    torch.manual_seed(0)
    first, last = nn.Linear(3, 4), nn.Linear(4, 2)
    x = torch.randn(5, 3)
    events: list[str] = []
    grads_at_end: list[torch.Tensor | None] = []

    def at_end() -> None:
        events.append("end")
        grads_at_end.append(None if first.weight.grad is None else first.weight.grad.clone())

    def on_last_grad(g: torch.Tensor) -> None:
        events.append("hook")
        th.queue_backward_callback(at_end)

    last.weight.register_hook(on_last_grad)
    first.weight.register_hook(lambda g: events.append("first"))
    last(torch.tanh(first(x))).square().sum().backward()
    events.append("returned")
    assert events == ["hook", "first", "end", "returned"]
    ref = torch.func.grad(lambda w: torch.func.functional_call(
        nn.Sequential(first, nn.Tanh(), last), {"0.weight": w}, (x,)).square().sum())(first.weight.detach())
    torch.testing.assert_close(grads_at_end[0], ref)


def test_queue_outside_backward_is_refused_by_the_engine():
    """The engine's queue exists only inside a backward pass: outside one it raises (the adapter
    passes the engine's own error on, the callers count it)."""
    with pytest.raises(RuntimeError):
        th.queue_backward_callback(lambda: None)


def test_backward_hook_dict_is_dropped_when_empty():
    w = nn.Parameter(torch.ones(3))
    assert w._backward_hooks is None
    handle = w.register_hook(lambda g: g * 2)
    assert isinstance(w._backward_hooks, dict) and len(w._backward_hooks) == 1
    th.drop_empty_backward_hooks(w)  # a hook left: kept
    assert len(w._backward_hooks) == 1
    handle.remove()
    assert w._backward_hooks == {}  # what the adapter exists for: an empty dict stays registered
    th.drop_empty_backward_hooks(w)
    assert w._backward_hooks is None
    (w * 3).sum().backward()
    assert w.grad.tolist() == [3.0, 3.0, 3.0]  # autograd works without the dict
    w.grad = None
    w.register_hook(lambda g: g * 2)  # and a new hook still takes effect
    (w * 3).sum().backward()
    assert w.grad.tolist() == [6.0, 6.0, 6.0]


def test_tensor_hooks_added_and_removed_without_handles():
    plain, owned = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    seen: list[tuple[str, list[float]]] = []
    owned.register_hook(lambda g: seen.append(("user", g.tolist())))  # a user's hook, kept first
    bodies = [lambda g, n=n: seen.append((n, g.tolist())) for n in ("plain", "owned")]
    th.add_tensor_hooks([plain, owned], bodies, key=-7)
    (plain * 2).sum().backward()
    (owned * 3).sum().backward()
    assert seen == [("plain", [2.0, 2.0, 2.0]), ("user", [3.0, 3.0]), ("owned", [3.0, 3.0])]
    th.remove_tensor_hooks([plain, owned], key=-7)
    assert plain._backward_hooks is None  # unregistered with autograd, not left empty
    assert len(owned._backward_hooks) == 1  # the user's stays
    seen.clear()
    plain.grad = owned.grad = None
    (plain * 2).sum().backward()
    (owned * 3).sum().backward()
    assert seen == [("user", [3.0, 3.0])] and plain.grad.tolist() == [2.0, 2.0, 2.0]
    th.remove_tensor_hooks([plain], key=-7)  # removing again is a no-op
    assert plain._backward_hooks is None


def test_fallbacks_when_a_member_is_gone(monkeypatch):
    """Without the engine's queue: an error the callers count. Without ``_backward_hooks``: no
    dict to drop, and the per-parameter hooks go through ``register_hook`` (the same hooks, each
    logged once)."""
    monkeypatch.setattr(compat, "DEGRADED", {})
    monkeypatch.setattr(th, "_ENGINE_QUEUE", None)
    with pytest.raises(compat.PrivateMemberMissing, match="queue_callback"):
        th.queue_backward_callback(lambda: None)

    class NoHooks:
        pass

    th.drop_empty_backward_hooks(NoHooks())  # type: ignore[arg-type]
    assert sorted(compat.DEGRADED) == ["torch.Tensor._backward_hooks"]

    w = nn.Parameter(torch.ones(2))
    monkeypatch.setattr(th, "_has_hook_dict", lambda t: False)
    seen: list[list[float]] = []
    th.add_tensor_hooks([w], [lambda g: seen.append(g.tolist())], key=-3)
    (w * 5).sum().backward()
    th.remove_tensor_hooks([w], key=-3)
    w.grad = None
    (w * 5).sum().backward()
    assert seen == [[5.0, 5.0]] and not w._backward_hooks
