"""The backward pass in progress, for the step meter (``trainer_agent/measure/step_stats.py``): whether
its end-of-backward measurement is queued, and the norms of the incoming gradients the noise scale
reads on its steps (:class:`BackwardPass`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainer_agent.compat import torch_private
from trainer_agent.measure import staged

__all__ = ["BackwardPass", "HELD_GRAD_BYTES"]

#: Incoming gradients the noise-scale hooks hold at most before norming them (bytes).
HELD_GRAD_BYTES = 32 << 20


class BackwardPass:
    """The backward pass in progress: whether its end-of-backward measurement is queued, and the
    norms of its incoming gradients (the noise scale's), each taken in one of three ways so that a
    pass issues a few fused norms, not one per tensor:

    - into a ``.grad`` that already holds a gradient (accumulation, in place): the incoming tensor
      is held and normed with the others of its bucket in one fused call, when ``HELD_GRAD_BYTES``
      are held or at the end of the pass (:meth:`hold`);
    - into an empty ``.grad`` (the first pass after ``zero_grad()``, which sets them to None):
      autograd moves the incoming tensor into ``.grad`` without a copy only if nothing else
      references it, so it is not held. Its parameter is noted instead (:meth:`fresh`), and its
      ``.grad`` is normed with the others of its bucket when the pass's gradients are all in,
      before DDP's end-of-backward callback copies the all-reduced values back into ``.grad``
      (:meth:`norm_fresh`): the same values, unless something rebound ``.grad`` in between, which
      :meth:`norm_fresh` detects (the pass's norm is then missed: absent, never wrong);
    - at once (:meth:`norm`), where ``.grad`` is rebound during the pass: DDP with
      ``gradient_as_bucket_view`` makes it a view of the bucket it all-reduces while the pass goes
      on. ``norm_dtype``: the accumulation dtype of a gradient's norm."""

    def __init__(self, buckets: int, norm_dtype: Callable[[torch.dtype], torch.dtype]) -> None:
        self.queued = False
        #: The incoming gradients' norms, one list per fused call (``foreach_results.results_vector`` joins
        #: them without a stack where a call's results lie in one buffer, as CUDA's do).
        self.norms: list[list[torch.Tensor] | torch.Tensor] = []
        #: A noted parameter's ``.grad`` was not the incoming gradient at the end of the pass.
        self.missed = False
        self._norm_dtype = norm_dtype
        # Incoming gradients held for one fused norm per bucket, their bytes.
        self._held: list[list[torch.Tensor]] = [[] for _ in range(buckets)]
        self._held_bytes = 0
        # Parameters whose incoming gradient went into an empty .grad: (index, its data pointer).
        self._fresh: list[tuple[int, int]] = []
        #: The ``DistributedDataParallel`` model the agent was attached to, if any (set by the agent).
        self.ddp: Any = None
        #: Whether the pass in progress notes incoming gradients into empty ``.grad`` (:meth:`begin`).
        self.grads_stay = False
        #: A noted ``.grad`` was found rebound to a view of other memory (a DDP with bucket views
        #: the agent was not given, e.g. a framework's wrapper): from then on each is normed at once.
        self.rebound = False

    def begin(self, first_step: bool) -> None:
        """A pass starts: whether an incoming gradient moved into an empty ``.grad`` stays there,
        unchanged, until the pass's end-of-backward callbacks (:meth:`fresh`). Not under DDP with
        ``gradient_as_bucket_view`` (``.grad`` becomes a view of the bucket it all-reduces during
        the pass), nor on the agent's first step under a DDP model with ``static_graph`` (DDP's
        first backward pass queues its all-reduce at its start, before the agent's callback); nor
        after a ``.grad`` was found rebound (:attr:`rebound`: a DDP the agent was not given)."""
        ddp = self.ddp
        self.grads_stay = not self.rebound and (
            ddp is None or not (ddp.gradient_as_bucket_view or (ddp.static_graph and first_step)))

    def norm(self, grad: torch.Tensor) -> None:
        """Norm an incoming gradient at once."""
        self.norms.append([torch.linalg.vector_norm(grad, dtype=self._norm_dtype(grad.dtype))])

    def hold(self, bucket: int, grad: torch.Tensor) -> None:
        """Hold an incoming gradient of ``bucket``; norm every held one once ``HELD_GRAD_BYTES`` are held."""
        self._held[bucket].append(grad)
        self._held_bytes += grad.numel() * grad.element_size()
        if self._held_bytes >= HELD_GRAD_BYTES:
            self.norm_held()

    def fresh(self, index: int, grad: torch.Tensor) -> None:
        """Note parameter ``index``, whose incoming ``grad`` goes into its empty ``.grad``."""
        self._fresh.append((index, grad.data_ptr()))

    def norm_fresh(self, params: Sequence[torch.Tensor], bucket_of: Sequence[int]) -> None:
        """Norm the noted parameters' ``.grad``, one fused call per bucket. Each must still be the
        incoming gradient: the same memory (autograd moved it in), or a copy of it that is no view
        (autograd copies an incoming gradient it cannot move). A view of other memory (a DDP
        bucket rebound in) or no ``.grad`` at all marks the pass :attr:`missed`; the first also
        :attr:`rebound`."""
        if not self._fresh:
            return
        groups: dict[int, list[torch.Tensor]] = {}
        for index, ptr in self._fresh:
            grad = params[index].grad
            if grad is None or (grad.data_ptr() != ptr and torch_private.view_base(grad) is not None):
                self.missed = True
                self.rebound = grad is not None
                break
            groups.setdefault(bucket_of[index], []).append(grad)
        self._fresh.clear()
        if self.missed:
            return
        for grads in groups.values():
            self._norm(grads)

    def norm_held(self) -> None:
        for held in self._held:
            if held:
                self._norm(held)
        self.release()

    def _norm(self, grads: list[torch.Tensor]) -> None:
        """The norms of ``grads`` (one bucket) into :attr:`norms`: one fused norm, or for many
        gradients one copy and one norm per stage of elements (``staged.staged_norms``: the
        noise scale reads their total norm only)."""
        dtype = self._norm_dtype(grads[0].dtype)
        plan = staged.plan_for(grads, grads[0].device)
        norms = None if plan is None else staged.attempt(staged.staged_norms, grads, plan, dtype)
        self.norms.append(torch_private.foreach_norm(grads, 2, dtype=dtype) if norms is None else norms)

    def release(self) -> None:
        for held in self._held:
            held.clear()
        self._held_bytes = 0

    def clear(self) -> None:
        """Drop the pass's norms, held gradients and noted parameters."""
        self.norms = []
        self.missed = False
        self._fresh.clear()
        self.release()
