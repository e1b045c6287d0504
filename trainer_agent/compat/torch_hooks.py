"""The autograd engine's private members the agent's gradient hooks reach (``Tensor._backward_hooks``,
the engine's end-of-pass queue), each behind a function with a documented stand-in; the other
private torch members are in ``trainer_agent/compat/torch_private.py``. Each member's test is in
``tests/agent/test_torch_hooks.py``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.variable import Variable

from trainer_agent.compat import PrivateMember, PrivateMemberMissing, degraded

__all__ = ["add_tensor_hooks", "drop_empty_backward_hooks", "queue_backward_callback", "remove_tensor_hooks"]

#: The releases every member below was checked against (tests/agent/test_torch_hooks.py passed on them).
CHECKED_VERSIONS = {"torch": "2.13.0"}

PRIVATE_MEMBERS = (
    PrivateMember("torch.autograd.Variable._execution_engine.queue_callback", "_execution_engine",
                  "queue_backward_callback", "test_queued_callback_runs_once_at_the_end_of_backward"),
    PrivateMember("torch.Tensor._backward_hooks", "_backward_hooks",
                  "drop_empty_backward_hooks", "test_backward_hook_dict_is_dropped_when_empty"),
    PrivateMember("torch.Tensor._backward_hooks", "_backward_hooks",
                  "add_tensor_hooks", "test_tensor_hooks_added_and_removed_without_handles"),
)


_ENGINE_QUEUE: Callable[[Callable[[], None]], None] | None = getattr(
    getattr(Variable, "_execution_engine", None), "queue_callback", None)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once when the backward pass now running ends (after every gradient hook and
    every callback queued before it, e.g. DDP's all-reduce; FSDP2 queues its own the same way).

    Reaches ``Variable._execution_engine.queue_callback``: the autograd engine's end-of-pass queue.
    No public API runs code at the end of a backward pass (tensor and module hooks run per
    gradient; ``torch.autograd.graph.register_multi_grad_hook`` fires when the listed gradients are
    ready, before DDP's all-reduce finishes). Without it: :class:`PrivateMemberMissing` (the caller
    counts it; the step's gradient metrics are not measured)."""
    if _ENGINE_QUEUE is None:
        raise PrivateMemberMissing("torch.autograd.Variable._execution_engine.queue_callback is gone: "
                                   "the end of the backward pass cannot be found, gradients are not measured")
    _ENGINE_QUEUE(callback)


_MISSING = object()


def drop_empty_backward_hooks(tensor: torch.Tensor) -> None:
    """Unregister ``tensor``'s gradient-hook dict with autograd when its last hook was removed.

    Reaches ``Tensor._backward_hooks``: ``register_hook`` creates the dict and removing the last
    handle leaves it empty but registered, so autograd keeps calling into Python for every gradient
    of that tensor. No public API drops it. Without it: the dict stays (the same values; one Python
    call per gradient, logged once)."""
    hooks = getattr(tensor, "_backward_hooks", _MISSING)
    if hooks is _MISSING:
        degraded("torch.Tensor._backward_hooks", "removed gradient hooks leave one Python call per gradient")
    elif hooks is not None and not hooks:
        tensor._backward_hooks = None


def add_tensor_hooks(tensors: Sequence[torch.Tensor], hooks: Sequence[Callable[[torch.Tensor], Any]],
                     key: int) -> None:
    """Put ``hooks[i]`` on ``tensors[i]`` as ``register_hook`` would (last in the tensor's hook dict,
    after any of the user's), under ``key``, a negative int (``register_hook``'s keys count up from 0).

    Reaches ``Tensor._backward_hooks``: ``register_hook`` costs ~3.4 us per tensor for its handle,
    setting the dict ~0.4 us. Without it: ``register_hook``, handles kept by ``key`` (logged once)."""
    if not _has_hook_dict(tensors[0] if tensors else torch.empty(0)):
        degraded("torch.Tensor._backward_hooks", "the per-parameter gradient hooks are registered one handle each")
        _HANDLES[key] = [t.register_hook(h) for t, h in zip(tensors, hooks)]
        return
    for t, hook in zip(tensors, hooks):
        if t._backward_hooks is None:
            t._backward_hooks = {key: hook}
        else:
            t._backward_hooks[key] = hook


def remove_tensor_hooks(tensors: Sequence[torch.Tensor], key: int) -> None:
    """Take :func:`add_tensor_hooks`' hooks under ``key`` off ``tensors``; an emptied dict is
    unregistered with autograd, as :func:`drop_empty_backward_hooks` does."""
    for handle in _HANDLES.pop(key, ()):
        handle.remove()
    for t in tensors:
        held = getattr(t, "_backward_hooks", None)
        if held is not None and held.pop(key, None) is not None and not held:
            t._backward_hooks = None


_HANDLES: dict[int, list[Any]] = {}


def _has_hook_dict(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "_backward_hooks")
