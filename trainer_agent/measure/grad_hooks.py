"""The tensor hooks the agent keeps on the parameters (:class:`GradHooks`): a sentinel per layer on
every step, a hook on every parameter only on the steps that read each incoming gradient.
``trainer_agent/measure/step_stats.py`` holds their bodies (``StepMeter``) and re-exports the class."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from trainer_agent.compat import torch_private

__all__ = ["GradHooks"]


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
        self._full: list[Any] = []

    @property
    def full(self) -> bool:
        """Whether every parameter is hooked now."""
        return bool(self._full)

    def want(self, full: bool) -> None:
        """Hook every parameter (``full``), or only the sentinels."""
        if full and not self._full:
            self._full = [p.register_hook(body) for p, body in zip(self.params, self._bodies)]
        elif not full and self._full:
            self._remove(self._full)

    def _remove(self, handles: list[Any]) -> None:
        for h in handles:
            h.remove()
        handles.clear()
        for p in self.params:
            # A leaf's hook dict stays registered with autograd after its last hook is removed,
            # and autograd then calls into Python for every gradient: drop it when empty.
            torch_private.drop_empty_backward_hooks(p)

    def remove(self) -> None:
        self._remove(self._full)
        self._remove(self._sentinels)
