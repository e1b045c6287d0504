"""The tensor hooks the agent keeps on the parameters (:class:`GradHooks`): a sentinel per layer on
every step, a hook on every parameter only on the steps that read each incoming gradient.
``trainer_agent/measure/step_stats.py`` holds their bodies (``StepMeter``) and re-exports the class."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch

from trainer_agent.compat import torch_hooks

__all__ = ["GradHooks"]

_KEYS = itertools.count()


class GradHooks:
    """The tensor hooks on the parameters, in two sets.

    - *Sentinels*, always: one hook on the first parameter of every layer, whose only work is to
      start the end-of-backward measurement once per backward pass (``sentinel``). A backward pass
      that reaches any layer runs one of them, so an ordinary step costs one Python call per layer
      reached, not one per parameter tensor.
    - *Per-parameter* hooks (``on_grad(index, grad)``), only while :meth:`want` says so: the steps
      that read each incoming gradient (the noise scale's micro-batch norms on report steps, the
      gradient verifier's armed step). Removed again afterwards, and the emptied hook dictionary
      is dropped from the tensor, so that autograd calls no Python for it on the next steps.
    """

    def __init__(self, params: list[torch.Tensor], layer_ids: list[int],
                 sentinel: Callable[[torch.Tensor], None], on_grad: Callable[[int, torch.Tensor], None]) -> None:
        self.params = params
        first: dict[int, int] = {}
        for i, layer in enumerate(layer_ids):
            first.setdefault(layer, i)
        self._sentinels = [params[i].register_hook(sentinel) for i in first.values()]
        self._bodies = [functools.partial(on_grad, i) for i in range(len(params))]
        self._full = False
        #: The key of the per-parameter hooks in each parameter's hook dict (negative: never one of
        #: ``register_hook``'s, which count up from 0).
        self._key = -1 - next(_KEYS)

    @property
    def full(self) -> bool:
        """Whether every parameter is hooked now."""
        return self._full

    def want(self, full: bool) -> None:
        """Hook every parameter (``full``), or only the sentinels. Without a handle per hook
        (``torch_hooks.add_tensor_hooks``): 5,000 parameters take ~2 ms, not ~17."""
        if full and not self._full:
            torch_hooks.add_tensor_hooks(self.params, self._bodies, self._key)
            self._full = True
        elif not full and self._full:
            torch_hooks.remove_tensor_hooks(self.params, self._key)
            self._full = False

    def _remove(self, handles: list[Any]) -> None:
        for h in handles:
            h.remove()
        handles.clear()
        for p in self.params:
            # A leaf's hook dict stays registered with autograd after its last hook is removed,
            # and autograd then calls into Python for every gradient: drop it when empty.
            torch_hooks.drop_empty_backward_hooks(p)

    def remove(self) -> None:
        self.want(False)
        self._remove(self._sentinels)
