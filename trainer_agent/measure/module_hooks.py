"""Hooks on the user's module that its copies do not carry.

A training loop copies its model after ``attach``: an exponential moving average of the weights
(``torch.optim.swa_utils.AveragedModel``, timm's ``ModelEmaV3``, a DINO teacher), a frozen
reference model for RLHF, ``torch.save(model)``. ``copy.deepcopy`` and pickle copy a module's hook
dicts with it. A bound method of one of the agent's parts would drag the agent into the copy (its
locks, threads and sockets cannot be copied: ``TypeError: cannot pickle '_thread.lock' object`` in
the user's code) or, for a copy that succeeded, time and count the copy's forward passes as the
training model's.

``module_hook(fn)`` wraps the agent's hook: called, it calls ``fn``; copied or pickled, it becomes
an ``InertHook``, which does nothing. The agent watches the module it was attached to, not its
copies (a copy that should be watched gets an agent of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["InertHook", "ModuleHook", "module_hook"]


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


def module_hook(fn: Callable[..., Any]) -> ModuleHook:
    """``fn`` as a module hook that copies of the module replace with an ``InertHook``."""
    return ModuleHook(fn)
