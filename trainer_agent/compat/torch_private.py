"""Every private member of torch the agent uses, one function (or name) each, but the autograd
engine's (``trainer_agent/compat/torch_hooks.py``); nothing else in the agent touches one
(``tests/architecture/test_private_members.py``).

Checked against torch 2.13.0 (:data:`CHECKED_VERSIONS`; the test of each member is named in
:data:`PRIVATE_MEMBERS`, in ``tests/agent/test_torch_private.py``). Where a member is gone the
adapter takes a documented slower or coarser path and logs it once
(:func:`trainer_agent.compat.degraded`), or raises :class:`~trainer_agent.compat.PrivateMemberMissing`
where nothing can stand in; the agent's callers count that as their own error, so training goes on.

Public equivalents used instead of a private member (no adapter needed): the default c10d store is
``dist.group.WORLD.get_group_store()`` (the store ``init_process_group`` made, the same object as
``distributed_c10d._get_default_store()``); a ``GradScaler``'s growth interval is
``get_growth_interval()``; httpcore's sync network backend is ``httpcore.SyncBackend``.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer_agent.compat import PrivateMember, PrivateMemberMissing, degraded

__all__ = [
    "CHECKED_VERSIONS", "PRIVATE_MEMBERS", "TorchDispatchMode", "copy_state_dict_metadata", "default_group_timeout",
    "chunk_cat", "dtensor_local", "dtensor_locals", "flat_cat", "foreach_abs", "foreach_clamp_min_", "foreach_copy_",
    "foreach_max", "foreach_mul", "foreach_neg_", "foreach_norm", "foreach_sub", "foreach_sub_",
    "grad_scaler_init_scale", "grad_scaler_scale", "join_allows_uneven_inputs", "optimizer_has_step_hooks",
    "stepping_grad_scaler", "tree_leaves", "version_counters", "view_base",
]

#: The releases every member below was checked against (tests/agent/test_torch_private.py passed on
#: them); a pin in constraints.txt past these fails tests/architecture/test_private_members.py until
#: the tests are run on the new release and this is updated.
CHECKED_VERSIONS = {"torch": "2.13.0"}


PRIVATE_MEMBERS = (
    PrivateMember("torch.Tensor._version", "_version", "version_counters",
                  "test_version_counters_count_in_place_writes"),
    PrivateMember("torch.Tensor._base", "_base", "view_base", "test_view_base_is_the_viewed_tensor"),
    PrivateMember("torch.amp.GradScaler._scale", "_scale", "grad_scaler_scale",
                  "test_grad_scaler_scale_is_the_live_scale_tensor"),
    PrivateMember("torch.amp.GradScaler._init_scale", "_init_scale", "grad_scaler_init_scale",
                  "test_grad_scaler_init_scale_is_the_constructor_value"),
    PrivateMember("torch.amp.GradScaler._maybe_opt_step", "_maybe_opt_step", "stepping_grad_scaler",
                  "test_stepping_grad_scaler_is_found_from_the_optimizer_step_hooks"),
    PrivateMember("torch.optim.Optimizer._optimizer_step_pre_hooks", "_optimizer_step_pre_hooks",
                  "optimizer_has_step_hooks", "test_optimizer_step_hook_registry"),
    PrivateMember("torch.distributed.tensor.DTensor._local_tensor", "_local_tensor", "dtensor_local",
                  "test_distributed_members_in_a_one_rank_gloo_group"),
    PrivateMember("torch.distributed.ProcessGroup._get_backend", "_get_backend", "default_group_timeout",
                  "test_distributed_members_in_a_one_rank_gloo_group"),
    PrivateMember("torch.distributed.Backend.options._timeout", "_timeout", "default_group_timeout",
                  "test_distributed_members_in_a_one_rank_gloo_group"),
    PrivateMember("torch.distributed.algorithms.Joinable._join_config", "_join_config", "join_allows_uneven_inputs",
                  "test_join_config_says_whether_uneven_inputs_are_allowed"),
    PrivateMember("torch.utils._pytree.tree_leaves", "_pytree", "tree_leaves",
                  "test_tree_leaves_is_torch_pytree"),
    PrivateMember("torch.utils._python_dispatch.TorchDispatchMode", "_python_dispatch", "TorchDispatchMode",
                  "test_torch_dispatch_mode_sees_every_operator"),
    PrivateMember("torch.nn.Module.state_dict()._metadata", "_metadata", "copy_state_dict_metadata",
                  "test_state_dict_metadata_carries_module_versions"),
    *(PrivateMember(f"torch._foreach_{op}", f"_foreach_{op}", f"foreach_{op}", "test_foreach_op_is_torch_and_matches_a_loop")
      for op in ("norm", "sub", "sub_", "copy_", "mul", "abs", "max", "neg_", "clamp_min_")),
    PrivateMember("torch._chunk_cat", "_chunk_cat", "chunk_cat", "test_chunk_cat_is_torch_and_matches_a_loop"),
)


# ---------------------------------------------------------------------- autograd

def _versions_unknown() -> bool:
    return not isinstance(getattr(torch.empty(0), "_version", None), int)


_NO_VERSION = _versions_unknown()


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (e.g. DDP's flat gradient bucket, for a gradient made a
    view of it by ``gradient_as_bucket_view``), or None when it is no view.

    Reaches ``Tensor._base``; no public API exposes it. Without it: None (the caller then takes
    its path per tensor; logged once)."""
    if not hasattr(tensor, "_base"):
        degraded("torch.Tensor._base", "gradient norms are taken per tensor, not from DDP's buckets")
        return None
    return tensor._base


def version_counters(tensors: Iterable[torch.Tensor]) -> tuple[Any, ...]:
    """Autograd's version counters of ``tensors`` (host ints; each in-place write moves one on):
    equal tuples mean no tensor was written in place in between.

    Reaches ``Tensor._version``; no public API exposes it. Without it: a fresh object on every call,
    so that two readings never compare equal (every cached copy is refreshed: the same values, one
    more copy per step; logged once)."""
    if _NO_VERSION:
        degraded("torch.Tensor._version", "parameter snapshots are re-copied on every measured step")
        return (object(),)
    return tuple(map(operator.attrgetter("_version"), tensors))


# ---------------------------------------------------------------------- GradScaler

def grad_scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """An enabled ``GradScaler``'s scale as the device tensor that ``update()`` changes in place
    (None before its first ``scale()``). Copy it to keep the value the gradients of this step carry.

    Reaches ``GradScaler._scale``. The public ``get_scale()`` returns a Python float, i.e. waits for
    the device every step. Without it: ``get_scale()`` as a tensor (the same value, one host sync
    per call; logged once)."""
    try:
        return scaler._scale
    except AttributeError:
        degraded("torch.amp.GradScaler._scale", "the loss scale is read with get_scale(), one host sync per step")
        return torch.tensor(scaler.get_scale(), dtype=torch.float64)


#: The ``GradScaler`` methods that call ``optimizer.step()`` from their own frame: ``step`` (an
#: optimizer that unscales inside its step, e.g. fused Adam, gets ``grad_scale``/``found_inf`` there)
#: and ``_maybe_opt_step`` (every other optimizer, after ``unscale_``).
_SCALER_STEP_FRAMES = frozenset({"step", "_maybe_opt_step"})


def stepping_grad_scaler(depth: int = 16) -> torch.amp.GradScaler | None:
    """The enabled ``GradScaler`` whose ``step()`` is running the optimizer step now, when called
    from an optimizer step hook; None when no scaler runs it (or it is disabled).

    ``GradScaler.step(optimizer)`` calls ``optimizer.step()`` from its own method, whose ``self``
    is the scaler: the caller's frames (at most ``depth`` of them) are read, not changed, for a
    method of those names bound to a ``GradScaler``. A scaler that calls the step another way is
    not found: None (the caller keeps measuring as without one)."""
    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            if frame.f_code.co_name in _SCALER_STEP_FRAMES:
                owner = frame.f_locals.get("self")
                if isinstance(owner, torch.amp.GradScaler) and owner.is_enabled():
                    return owner
        return None
    finally:
        del frame


def grad_scaler_init_scale(scaler: torch.amp.GradScaler) -> float:
    """The ``init_scale`` an enabled ``GradScaler`` was built with (not its current scale).

    Reaches ``GradScaler._init_scale``: there is no public getter (``get_scale()`` and
    ``state_dict()["scale"]`` give the current scale once it has moved). Without it: NaN (the
    pre-flight check reports the value as unknown; logged once)."""
    try:
        return float(scaler._init_scale)
    except AttributeError:
        degraded("torch.amp.GradScaler._init_scale", "the pre-flight check cannot read the initial loss scale")
        return float("nan")


# ---------------------------------------------------------------------- optimizer

def _step_hooks_unknown() -> bool:
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    return not isinstance(getattr(probe, "_optimizer_step_pre_hooks", None), dict)


_NO_STEP_HOOKS = _step_hooks_unknown()


def optimizer_has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` ran ``Optimizer.__init__`` and so has its own step-hook registry (a
    framework's wrapper that subclasses ``Optimizer`` without calling it forwards ``param_groups``
    and would fail in ``register_step_pre_hook``).

    Reaches ``Optimizer._optimizer_step_pre_hooks``: no public API says whether the registry
    exists. Without it (a torch that renamed it): whether ``param_groups`` is the object's own
    attribute, which ``Optimizer.__init__`` sets and a forwarding wrapper does not (logged once)."""
    if _NO_STEP_HOOKS:
        degraded("torch.optim.Optimizer._optimizer_step_pre_hooks",
                 "optimizer wrappers are told apart by their own param_groups attribute")
        return "param_groups" in vars(optimizer)
    return isinstance(getattr(optimizer, "_optimizer_step_pre_hooks", None), dict)


# ---------------------------------------------------------------------- torch.distributed

def join_allows_uneven_inputs(model: Any) -> bool:
    """Whether ``model`` (a ``Joinable``: DDP) runs inside ``torch.distributed.algorithms.Join``
    with uneven inputs allowed (``throw_on_early_termination=False``). Reaches
    ``Joinable._join_config``, which ``Join.__enter__`` sets: no public API tells."""
    config = getattr(model, "_join_config", None)
    return bool(getattr(config, "enable", False)) and not getattr(config, "throw_on_early_termination", True)


try:  # torch >= 2.5: the public DTensor package
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:  # pragma: no cover - a torch built without distributed support
    _DTENSOR = None


def dtensor_local(t: Any) -> torch.Tensor:
    """A DTensor's local shard itself (no copy, no communication, no autograd node).

    Reaches ``DTensor._local_tensor``. The public ``to_local()`` is differentiable: with grad mode
    on it returns a new view with an autograd node on every call (each call costs an autograd
    Function), and for a ``Parameter`` a new view even without grad mode (torch 2.13). Without it:
    ``to_local()`` under ``no_grad`` (a view of the same storage, slower; logged once)."""
    try:
        return t._local_tensor
    except AttributeError:
        degraded("torch.distributed.tensor.DTensor._local_tensor", "local shards are read with to_local()")
        with torch.no_grad():
            return t.to_local()


def dtensor_locals(tensors: Iterable[Any]) -> list[Any]:
    """Per tensor: a DTensor's local shard itself (:func:`dtensor_local`), any other value (a plain
    tensor, None) as it is; one pass, without a call per tensor where ``DTensor._local_tensor``
    is there."""
    if _DTENSOR is None:
        return list(tensors)
    try:
        return [t._local_tensor if isinstance(t, _DTENSOR) else t for t in tensors]
    except AttributeError:
        return [dtensor_local(t) if isinstance(t, _DTENSOR) else t for t in tensors]


def default_group_timeout() -> timedelta:
    """The timeout ``init_process_group`` gave the default group's CPU backend, so that a side
    group made with it fails no sooner and no later than the training's collectives.

    Reaches ``ProcessGroup._get_backend(device)`` and the backend's ``options._timeout``: no public
    API reads a group's timeout back (``distributed_c10d._get_pg_config`` does not carry it). A
    default group with no CPU backend (NCCL only): ``dist.default_pg_timeout``. Without the members:
    the same default (logged once)."""
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    except RuntimeError:  # no backend for CPU tensors
        return dist.default_pg_timeout
    except AttributeError:
        degraded("torch.distributed.ProcessGroup._get_backend", "side groups get torch's default timeout")
        return dist.default_pg_timeout
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    if not isinstance(timeout, timedelta):
        degraded("torch.distributed.Backend.options._timeout", "side groups get torch's default timeout")
        return dist.default_pg_timeout
    return timeout


# ---------------------------------------------------------------------- pytree, dispatch modes

def _leaves(tree: Any) -> list[Any]:
    """Leaves of lists, tuples (named ones included) and dicts (values, in order): the containers
    torch's pytree flattens that do not need its registry."""
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in _leaves(item)]
    return [tree]


#: ``tree_leaves(tree)``: the leaves of a nested structure in torch's own order, through every class
#: registered with torch's pytree (e.g. a framework's model-output classes). Reaches
#: ``torch.utils._pytree``: torch 2.13 has no public pytree module. Without it: :func:`_leaves`
#: (lists, tuples and dicts only; logged once).
try:
    from torch.utils._pytree import tree_leaves
except ImportError:  # pragma: no cover - a torch without the module
    degraded("torch.utils._pytree.tree_leaves",
             "outputs are searched through lists, tuples and dicts only, not pytree-registered classes")
    tree_leaves = _leaves

#: ``TorchDispatchMode``: the base class of a mode whose ``__torch_dispatch__`` sees every operator
#: (below autograd) while it is entered. Reaches ``torch.utils._python_dispatch``; torch 2.13 has no
#: public path for it (``torch.overrides`` has only ``TorchFunctionMode``, which runs above autograd
#: and misses the backward pass). Without it: building a mode raises :class:`PrivateMemberMissing`.
try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - a torch without the module
    degraded("torch.utils._python_dispatch.TorchDispatchMode", "the memory trace cannot run")

    class TorchDispatchMode:  # type: ignore[no-redef]
        """Stands in for the missing base class: building a mode raises."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise PrivateMemberMissing("torch.utils._python_dispatch.TorchDispatchMode is gone: "
                                       "the memory trace cannot see the operators that allocate")


# ---------------------------------------------------------------------- state dicts

def copy_state_dict_metadata(source: Any, target: Any) -> None:
    """Give ``target`` (a copy of the state dict ``source``) the per-module versions that
    ``load_state_dict`` reads back (e.g. BatchNorm's, for state dicts from before a layout change).

    Reaches ``state_dict()._metadata``, the attribute ``Module.state_dict`` sets on the dict it
    returns (documented with ``Module._version``); there is no public accessor. A dict without it
    (an optimizer's, a user's) has nothing to copy; under a torch that renamed it, nothing is copied
    and loading treats the versions as unknown."""
    metadata = getattr(source, "_metadata", None)
    if metadata is not None:
        target._metadata = copy.deepcopy(metadata)


# ---------------------------------------------------------------------- foreach list ops

def _in_place(method: Callable[..., Any]) -> Callable[..., None]:
    def run(tensors: list[torch.Tensor], other: Any = None) -> None:
        others = other if isinstance(other, (list, tuple)) else [other] * len(tensors)
        for t, o in zip(tensors, others, strict=True):
            if other is None:
                method(t)
            else:
                method(t, o)
    return run


#: What each ``torch._foreach_<op>`` computes, one tensor at a time (its stand-in when it is gone).
_LOOPS: dict[str, Callable[..., Any]] = {
    "norm": lambda ts, ord=2, dtype=None: [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in ts],
    "sub": lambda ts, others: [t - o for t, o in zip(ts, others, strict=True)],
    "mul": lambda ts, other: [t * other for t in ts],
    "abs": lambda ts: [t.abs() for t in ts],
    "max": lambda ts: [t.max() for t in ts],
    "sub_": _in_place(torch.Tensor.sub_),
    "copy_": _in_place(torch.Tensor.copy_),
    "neg_": _in_place(torch.Tensor.neg_),
    "clamp_min_": _in_place(torch.Tensor.clamp_min_),
}


def _foreach(op: str) -> Callable[..., Any]:
    fused = getattr(torch, f"_foreach_{op}", None)
    if fused is None:
        degraded(f"torch._foreach_{op}", "a per-tensor loop (the same values, one kernel per tensor)")
        return _LOOPS[op]
    return fused


# The fused multi-tensor ops (one kernel per chunk of a list, as torch.optim's foreach paths use):
# ``torch._foreach_*`` are private in torch 2.13 (the public, beta ``torch.foreach`` module is newer).
# Without one: its per-tensor loop in :data:`_LOOPS`, the same values (logged once).
foreach_norm = _foreach("norm")
foreach_sub = _foreach("sub")
foreach_sub_ = _foreach("sub_")
foreach_copy_ = _foreach("copy_")
foreach_mul = _foreach("mul")
foreach_abs = _foreach("abs")
foreach_max = _foreach("max")
foreach_neg_ = _foreach("neg_")
foreach_clamp_min_ = _foreach("clamp_min_")


# ---------------------------------------------------------------------- one copy of many tensors

_CHUNK_CAT = getattr(torch, "_chunk_cat", None)


def _chunk_cat_loop(tensors: list[torch.Tensor], chunks: int, out: torch.Tensor | None = None) -> torch.Tensor:
    columns = []
    for t in tensors:
        rows = t.reshape(t.shape[0] if t.dim() else 1, -1)
        height = -(-rows.shape[0] // chunks)
        padded = torch.nn.functional.pad(rows, (0, 0, 0, height * chunks - rows.shape[0]))
        columns.append(padded.reshape(chunks, -1))
    return torch.cat(columns, dim=1) if out is None else torch.cat(columns, dim=1, out=out)


def chunk_cat(tensors: list[torch.Tensor], chunks: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch._chunk_cat(tensors, 0, chunks)``: each tensor (one device and dtype, none 0-dim) cut
    along its first dimension into ``chunks`` equal parts (zero-padded at its end), and part ``k``
    of every tensor, one after the other, as row ``k`` of a (chunks, columns) tensor (into ``out``
    when given, which may be float32 for bfloat16 tensors: the CUDA kernel casts). On CUDA one
    kernel for any number of contiguous tensors (FSDP2 packs its reduce-scatter input with it),
    where ``torch.cat`` launches once per 128 inputs. Without it, the same layout padded and
    joined per tensor: the same values (logged once)."""
    if _CHUNK_CAT is None:
        degraded("torch._chunk_cat", "the tensors padded and joined one by one (the same values, more launches)")
        return _chunk_cat_loop(tensors, chunks, out)
    return _CHUNK_CAT(tensors, 0, chunks) if out is None else _CHUNK_CAT(tensors, 0, chunks, out=out)


def flat_cat(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The elements of ``tensors`` (one device and dtype, none 0-dim), each flattened, one tensor
    after the other, as one 1-D tensor (into ``out``, 1-D, when given): :func:`chunk_cat` with
    one chunk, which pads nothing."""
    if out is None:
        return chunk_cat(tensors, 1).view(-1)
    chunk_cat(tensors, 1, out=out.view(1, -1))
    return out
