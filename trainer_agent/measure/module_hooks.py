"""Hooks on the user's module that its copies do not carry.

A training loop copies its model after ``attach``: an exponential moving average of the weights
(``torch.optim.swa_utils.AveragedModel``, timm's ``ModelEmaV3``, a DINO teacher), a frozen
reference model for RLHF, ``torch.save(model)``. ``copy.deepcopy`` and pickle copy a module's hook
dicts with it. A bound method of one of the agent's parts would drag the agent into the copy (its
locks, threads and sockets cannot be copied: ``TypeError: cannot pickle '_thread.lock' object`` in
the user's code) or, for a copy that succeeded, time and count the copy's forward passes as the
training model's.

:func:`add_forward_pre_hook` and :func:`add_forward_hook` register the agent's hooks (every one it
puts on a module goes through them), each wrapped in a ``ModuleHook``: called, it calls the agent;
copied or pickled, it becomes an ``InertHook``, which does nothing. The agent watches the module it
was attached to, not its copies (a copy that should be watched gets an agent of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["InertHook", "ModuleHook", "add_forward_hook", "add_forward_pre_hook"]


class InertHook:
    """What a copy of the model holds in place of the agent's hook: returns ``None`` (the module's
    arguments and output unchanged)."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return self

    def __repr__(self) -> str:
        return "InertHook()"


class ModuleHook:
    """The agent's hook on a module; see the module docstring."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple[type[InertHook], tuple[()]]:
        return InertHook, ()

    def __repr__(self) -> str:
        return f"ModuleHook({self.fn!r})"


def add_forward_pre_hook(module: nn.Module, fn: Callable[..., Any]) -> RemovableHandle:
    """``module.register_forward_pre_hook(fn)``, ``fn`` wrapped in a ``ModuleHook``."""
    return module.register_forward_pre_hook(ModuleHook(fn))


def add_forward_hook(module: nn.Module, fn: Callable[..., Any], *, always_call: bool = False) -> RemovableHandle:
    """``module.register_forward_hook(fn, always_call=...)``, ``fn`` wrapped in a ``ModuleHook``."""
    return module.register_forward_hook(ModuleHook(fn), always_call=always_call)
