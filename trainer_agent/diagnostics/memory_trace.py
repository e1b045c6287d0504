"""Memory-leak localisation (the stability guide, 5.2): for a few steps, which layer (or the
training loop) keeps memory alive from one step to the next.

    agent.trace_memory(steps=3)      # on command, e.g. when the memory_growth alert fired
    ...                              # the next 3 + 1 end_step calls trace; then
    agent.memory_report              # [MemoryOwner(owner, bytes_per_step, tensors), ...], worst first

While tracing (on the process's thread; a ``TorchDispatchMode``), every new storage an operator
allocates is tagged with where it was created: the innermost module whose forward is running
(module hooks keep the stack), or ``<training loop>`` outside any forward. Tensors saved for
backward are recorded too (``saved_tensors_hooks``). At each ``end_step`` the live tensors are
counted (``gc.get_objects()``, storages de-duplicated): a storage created during an earlier traced
step and still alive was retained across steps. Retained storages of tensors that autograd saved
for backward mean a computation graph outlived its step: something the loop keeps (the guide's
example, a loss appended to a list without ``.item()`` or ``.detach()``) holds the whole graph,
whatever layer created its activations, so they are charged to ``<training loop: graph kept
alive>``, as is every retained tensor that still has a ``grad_fn`` (after ``backward()`` a kept
loss holds the graph's nodes, whose saved activations autograd has already freed unless the
graph was retained). Other retained storages are charged to the module that created them (e.g. a layer that
caches its activations). ``bytes_per_step`` is the growth: retained bytes over traced steps.

The weights, gradients and optimizer state are created before or outside the traced forward passes
and are stable from step to step: they never count as growth (a storage created during the trace
that the optimizer keeps, e.g. Adam's moments on its first step, is charged once to the loop).

Tracing is expensive (every operator goes through Python): a few steps only. On CUDA the
backward pass runs on autograd's device threads, so its allocations are not tagged; the forward
passes and the loop are.

**CUDA allocator accounting** (only when the model's parameters are on a CUDA device): around
every module's forward the trace also reads ``torch.cuda.memory_allocated`` and charges each
module the bytes its own forward left allocated (its total minus its children's: the activations
it saved for backward and its output), averaged per traced step (``MemoryTrace.cuda_forward``),
and records the allocator's level at every ``end_step``: ``cuda_growth_per_step`` is its growth
per traced step, which the retained owners above should account for. Reading the counter is a
host-side query of the caching allocator (no device sync).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer_agent.compat.torch_private import TorchDispatchMode, tree_leaves
from trainer_agent.measure.module_hooks import add_forward_hook, add_forward_pre_hook

__all__ = ["MemoryOwner", "MemoryTrace", "LOOP", "GRAPH", "to_wire"]

LOOP = "<training loop>"
GRAPH = "<training loop: graph kept alive>"


@dataclass(frozen=True, slots=True)
class MemoryOwner:
    owner: str
    bytes_per_step: float
    tensors: int


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of ``t``'s storage; None for a tensor without memory of its own:
    sparse or meta tensors, and the FakeTensors and FunctionalTensors that torch.compile's tracing
    leaves in the process (a FunctionalTensor's storage refuses its data pointer; a FakeTensor's
    reads 0, with a warning the census silences)."""
    try:
        s = t.untyped_storage()
        ptr = s.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (ptr, s.nbytes()) if ptr else None


class _Tagger(TorchDispatchMode):
    def __init__(self, trace: MemoryTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {p[0] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and (p := _storage(t))}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                p = _storage(t)
                if p is not None and p[0] and p[0] not in inputs:
                    self.trace.created[p[0]] = (self.trace.where(), p[1], self.trace.step)
        return out


class MemoryTrace:
    """Traces ``steps`` steps of ``model`` (see the module docstring). ``on_end_step`` is called
    at each ``end_step``: the first call starts the census, ``steps`` further calls count."""

    def __init__(self, model: nn.Module, steps: int, on_done: Callable[[list[MemoryOwner]], None], *,
                 device: torch.device | None = None) -> None:
        if type(steps) is not int or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        self.steps = steps
        self.step = 0
        self.created: dict[int, tuple[str, int, int]] = {}
        self._saved: list[tuple[weakref.ref, int]] = []
        self._stack: list[str] = []
        self._on_done = on_done
        self._retained: dict[str, tuple[int, int]] = {}
        names = {m: n or type(model).__name__ for n, m in model.named_modules()}
        self._handles = []
        for module, name in names.items():
            self._handles.append(add_forward_pre_hook(module, lambda m, a, n=name: self._stack.append(n)))
            self._handles.append(add_forward_hook(module, lambda m, a, o: self._pop(), always_call=True))
        #: CUDA only: bytes each module's own forward left allocated, per traced step (worst first
        #: once the trace is over), and the allocator's growth per traced step.
        self.cuda_forward: dict[str, float] = {}
        self.cuda_growth_per_step: float | None = None
        self._cuda = device if device is not None and device.type == "cuda" else None
        if self._cuda is not None:
            self._cuda_levels: list[int] = []
            self._cuda_stack: list[list[int]] = []  # [allocated before, children's bytes]
            for module, name in names.items():
                self._handles.append(add_forward_pre_hook(module, lambda m, a: self._cuda_enter()))
                self._handles.append(add_forward_hook(module, lambda m, a, o, n=name: self._cuda_exit(n),
                                                      always_call=True))
        self._mode = _Tagger(self)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._mode.__enter__()
        self._saved_hooks.__enter__()
        self.active = True

    def _cuda_enter(self) -> None:
        self._cuda_stack.append([torch.cuda.memory_allocated(self._cuda), 0])

    def _cuda_exit(self, name: str) -> None:
        if not self._cuda_stack:
            return
        before, children = self._cuda_stack.pop()
        total = torch.cuda.memory_allocated(self._cuda) - before
        if self._cuda_stack:
            self._cuda_stack[-1][1] += total
        if self.step >= 1:  # the steps that count (the first end_step starts the census)
            self.cuda_forward[name] = self.cuda_forward.get(name, 0.0) + (total - children)

    def _pop(self) -> None:
        if self._stack:
            self._stack.pop()

    def where(self) -> str:
        return self._stack[-1] if self._stack else LOOP

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            self._saved.append((weakref.ref(t), self.step))
        except TypeError:
            pass
        return t

    def on_end_step(self) -> bool:
        """Count what the finished step left alive; True when the trace is over."""
        self.step += 1
        if self._cuda is not None:
            self._cuda_levels.append(torch.cuda.memory_allocated(self._cuda))
        if self.step <= self.steps:
            return False
        if self._cuda is not None:
            self.cuda_growth_per_step = (self._cuda_levels[-1] - self._cuda_levels[0]) / self.steps
            self.cuda_forward = dict(sorted(((k, v / self.steps) for k, v in self.cuda_forward.items()),
                                            key=lambda kv: -kv[1]))
        with warnings.catch_warnings():  # (a FakeTensor's data pointer: _storage)
            warnings.simplefilter("ignore", UserWarning)
            self._census()
        self.stop()
        report = [MemoryOwner(owner, nbytes / self.steps, count)
                  for owner, (nbytes, count) in self._retained.items() if nbytes > 0]
        report.sort(key=lambda r: -r.bytes_per_step)
        self._on_done(report)
        return True

    def _census(self) -> None:
        # Storages of tensors saved for backward that are still alive: their graph outlived its step.
        graph = {p[0] for ref, step in self._saved if (t := ref()) is not None and (p := _storage(t))}
        seen: set[int] = set()
        retained: dict[str, list[int]] = {}
        self._mode.__exit__(None, None, None)  # the census's own tensors are not tagged
        try:
            gc.collect()
            for obj in gc.get_objects():
                if not issubclass(type(obj), torch.Tensor):  # type(): no __class__ lookups on foreign objects
                    continue
                p = _storage(obj)
                if p is None or p[0] in seen:
                    continue
                seen.add(p[0])
                tag = self.created.get(p[0])
                if tag is None or tag[2] >= self.step - 1:
                    continue  # not created during the trace, or in the step that just ended
                # A tensor with a graph (e.g. a kept loss) or one a live graph saved: the loop's doing.
                owner = GRAPH if p[0] in graph or obj.grad_fn is not None else tag[0]
                slot = retained.setdefault(owner, [0, 0])
                slot[0] += tag[1]
                slot[1] += 1
            # Saved tensors that are not Python-visible elsewhere (held only by the graph).
            for ref, step in self._saved:
                t = ref()
                if t is None or step >= self.step - 1:
                    continue
                p = _storage(t)
                if p is None or p[0] in seen or p[0] not in self.created:
                    continue
                seen.add(p[0])
                slot = retained.setdefault(GRAPH, [0, 0])
                slot[0] += p[1]
                slot[1] += 1
        finally:
            self._mode.__enter__()
        self._retained = {k: (v[0], v[1]) for k, v in retained.items()}

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        self._saved_hooks.__exit__(None, None, None)
        self._mode.__exit__(None, None, None)
        for h in self._handles:
            h.remove()
        self._handles = []
        self._saved = []
        self.created = {}


def to_wire(trace: MemoryTrace | None, report: list[MemoryOwner], *, rank: int, step: int, cuda: bool) -> Any:
    """The controller's ``MemoryReport`` of a finished ``trace`` (its worst owners first)."""
    from trainguard.protocol.base import printable
    from trainguard.protocol.wire import MemoryOwnerEntry, MemoryReport

    forward = trace.cuda_forward if trace is not None else {}
    return MemoryReport(
        rank=rank, step=step, steps=trace.steps if trace is not None else 1, device="cuda" if cuda else "cpu",
        owners=[MemoryOwnerEntry(owner=printable(r.owner)[:512], bytes_per_step=r.bytes_per_step, tensors=r.tensors)
                for r in report[:32]],
        allocator_growth_bytes_per_step=trace.cuda_growth_per_step if trace is not None else None,
        layer_forward_bytes=[MemoryOwnerEntry(owner=printable(k)[:512], bytes_per_step=max(v, 0.0), tensors=0)
                             for k, v in list(forward.items())[:32]])
