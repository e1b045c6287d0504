"""The private torch members of ``trainer_agent/compat/torch_private.py``, each exercised on the
real torch object: every test fails when its member is gone or no longer means what the agent
relies on (each adapter falls back quietly, so the tests also check that no fallback was taken)."""

from __future__ import annotations

import math
import os
from collections import namedtuple
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks
from trainer_agent.compat import DEGRADED
from trainer_agent.compat import torch_private as tp


pytestmark = pytest.mark.usefixtures("no_adapter_fallback")


def test_version_counters_count_in_place_writes():
    a, b = torch.zeros(4), torch.zeros(2)
    start = tp.version_counters([a, b])
    assert all(type(v) is int for v in start)
    _ = a + 1, b.sum()  # reads
    assert tp.version_counters([a, b]) == start
    a.add_(1)
    assert tp.version_counters([a, b]) == (start[0] + 1, start[1])
    a[:2].mul_(2)  # a write through a view moves the base's counter too
    assert tp.version_counters([a, b]) == (start[0] + 2, start[1])
    with torch.no_grad():
        b.copy_(torch.ones(2))
    assert tp.version_counters([a, b]) == (start[0] + 2, start[1] + 1)


def test_view_base_is_the_viewed_tensor():
    flat = torch.zeros(10)
    view = flat[2:8].view(2, 3)
    assert tp.view_base(view) is flat and tp.view_base(flat) is None
    view.add_(1)  # the view writes into its base
    assert float(flat.sum()) == 6.0
    assert tp.view_base(flat.clone()) is None


def test_grad_scaler_scale_is_the_live_scale_tensor():
    """Before the first ``scale()``: None. After it: the tensor whose value is ``get_scale()``, the
    very one ``update()`` changes in place (backoff on an inf, growth after the interval)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**7, growth_interval=1)
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    assert tp.grad_scaler_scale(scaler) is None
    scaler.scale((w * 2).sum()).backward()
    scale = tp.grad_scaler_scale(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == scaler.get_scale() == 2.0**7
    torch.testing.assert_close(w.grad, torch.full((2,), 2.0 * 2.0**7))  # the gradients carry it
    scaler.step(opt)
    scaler.update()  # growth_interval=1: doubled
    assert tp.grad_scaler_scale(scaler) is scale and scale.item() == scaler.get_scale() == 2.0**8
    opt.zero_grad()
    scaler.scale((w * math.inf).sum()).backward()
    scaler.step(opt)
    scaler.update()  # an inf: backed off by half
    assert tp.grad_scaler_scale(scaler) is scale and scale.item() == scaler.get_scale() == 2.0**7


def test_grad_scaler_init_scale_is_the_constructor_value():
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=1)
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(2):
        scaler.scale(w.sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2048.0  # the scale moved on
    assert tp.grad_scaler_init_scale(scaler) == 512.0
    assert scaler.get_growth_interval() == 1  # the public getter the pre-flight check uses


def test_stepping_grad_scaler_is_found_from_the_optimizer_step_hooks():
    """From an optimizer step hook: the GradScaler whose ``step()`` runs the step, for an optimizer
    the scaler unscales first (``_maybe_opt_step``) and for one that unscales inside its own step
    (fused Adam: called from ``step``); None for a plain ``optimizer.step()``, a disabled scaler's
    step, and outside any step."""
    w = nn.Parameter(torch.ones(4))
    for opt in (torch.optim.SGD([w], lr=0.1), torch.optim.Adam([w], lr=0.1, fused=True)):
        assert getattr(opt, "_step_supports_amp_scaling", False) == isinstance(opt, torch.optim.Adam)
        seen: list = []
        opt.register_step_pre_hook(lambda o, a, k: seen.append(tp.stepping_grad_scaler()))
        for scaler in (torch.amp.GradScaler("cpu", init_scale=4.0), torch.amp.GradScaler("cpu", enabled=False), None):
            opt.zero_grad()
            ((scaler.scale(w.sum()) if scaler is not None else w.sum())).backward()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            want = scaler if scaler is not None and scaler.is_enabled() else None
            assert len(seen) == 1 and seen.pop() is want, (type(opt).__name__, scaler)
    assert tp.stepping_grad_scaler() is None


class _ForwardingOptimizer(torch.optim.Optimizer):
    """Like a framework's wrapper: an ``Optimizer`` subclass that skips ``Optimizer.__init__`` and
    forwards to the optimizer inside."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:  # no super().__init__()
        self.optimizer = inner

    @property
    def param_groups(self):  # type: ignore[override]
        return self.optimizer.param_groups


def test_optimizer_step_hook_registry():
    w = nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([w], lr=0.5)
    assert tp.optimizer_has_step_hooks(inner)
    assert not tp.optimizer_has_step_hooks(_ForwardingOptimizer(inner))
    with pytest.raises(AttributeError):  # what the check spares the agent
        _ForwardingOptimizer(inner).register_step_pre_hook(lambda *a: None)
    seen: list[list[float]] = []
    assert inner._optimizer_step_pre_hooks == {}
    handle = inner.register_step_pre_hook(lambda opt, args, kwargs: seen.append(w.tolist()))
    assert len(inner._optimizer_step_pre_hooks) == 1  # the registry the hook went to
    w.grad = torch.ones(2)
    inner.step()
    assert seen == [[1.0, 1.0]] and w.tolist() == [0.5, 0.5]
    handle.remove()
    assert inner._optimizer_step_pre_hooks == {}


def test_tree_leaves_is_torch_pytree():
    """Torch's own flattening, through the classes registered with it (a namedtuple, a dict in
    insertion order, nested lists), the same order as a hand-written walk."""
    from torch.utils import _pytree

    assert tp.tree_leaves is _pytree.tree_leaves
    Out = namedtuple("Out", "loss logits")
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    tree = {"z": Out(a, [b, (c, None)]), "a": [d, 7]}
    assert [id(x) for x in tp.tree_leaves(tree)] == [id(x) for x in (a, b, c, None, d, 7)]
    assert [id(x) for x in tp._leaves(tree)] == [id(x) for x in (a, b, c, None, d, 7)]  # the stand-in agrees


def test_torch_dispatch_mode_sees_every_operator():
    """A mode built on the adapter's base class sees each aten operator once, the backward pass's
    included, with the tensors it made."""
    seen: list[str] = []

    class Recorder(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    w = torch.ones(3, requires_grad=True)
    with Recorder():
        y = (w * 2).sum()
        y.backward()
    assert y.item() == 6.0 and w.grad.tolist() == [2.0, 2.0, 2.0]
    assert seen[:2] == ["mul", "sum"]
    assert "mul" in seen[2:] or "expand" in seen[2:]  # the backward pass ran under the mode too


class _Versioned(nn.Module):
    _version = 3

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(2)


def test_state_dict_metadata_carries_module_versions():
    """``state_dict()._metadata`` holds each module's version, the copy keeps it, and
    ``load_state_dict`` reads it: BatchNorm accepts a version-1 dict without
    ``num_batches_tracked`` and refuses the same dict claiming version 2."""
    model = _Versioned()
    state = model.state_dict()
    assert state._metadata[""]["version"] == 3 and state._metadata["bn"]["version"] == nn.BatchNorm1d._version == 2
    copied = type(state)((k, v.clone()) for k, v in state.items())
    tp.copy_state_dict_metadata(state, copied)
    assert copied._metadata == state._metadata and copied._metadata is not state._metadata
    old = type(state)((k, v) for k, v in copied.items() if not k.endswith("num_batches_tracked"))
    tp.copy_state_dict_metadata(copied, old)
    old._metadata["bn"]["version"] = 1
    _Versioned().load_state_dict(old)  # version 1: BatchNorm fills the missing counter in
    old._metadata["bn"]["version"] = 2
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        _Versioned().load_state_dict(old)
    plain: dict = {}
    tp.copy_state_dict_metadata({"w": torch.ones(1)}, plain)  # a dict without metadata: nothing to copy
    assert not hasattr(plain, "_metadata")


_FOREACH_CASES = {
    "norm": ((2,), {}), "sub": ((None,), {}), "sub_": ((None,), {}), "copy_": ((None,), {}), "mul": ((0.5,), {}),
    "abs": ((), {}), "max": ((), {}), "neg_": ((), {}), "clamp_min_": ((0.25,), {}),
}


def _lists() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(5, generator=g), torch.randn(2, 3, generator=g), torch.tensor([1.0, -math.inf, math.nan])]
    ys = [torch.randn(5, generator=g), torch.randn(2, 3, generator=g), torch.tensor([0.5, 2.0, -1.0])]
    return xs, ys


@pytest.mark.parametrize("op", sorted(_FOREACH_CASES))
def test_foreach_op_is_torch_and_matches_a_loop(op):
    """Each adapter name is torch's own fused op, and the per-tensor loop that stands in for it
    computes the same values (NaN and infinities included), in place where the op is in place."""
    fused = getattr(tp, f"foreach_{op}")
    assert fused is getattr(torch, f"_foreach_{op}")
    args, kwargs = _FOREACH_CASES[op]
    results = []
    for impl in (fused, tp._LOOPS[op]):
        xs, ys = _lists()
        call_args = [ys if a is None else a for a in args]
        out = impl(xs, *call_args, **kwargs)
        results.append(list(out) if out is not None else xs)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True)
    if op == "norm":  # the orders and dtypes the agent passes
        for ord_, dtype in ((2, torch.float64), (1, torch.float64), (0, torch.float32), (2, None)):
            xs, _ = _lists()
            for a, b in zip(fused(xs, ord_, dtype=dtype), tp._LOOPS["norm"](xs, ord_, dtype=dtype), strict=True):
                torch.testing.assert_close(a, b, equal_nan=True)


def test_chunk_cat_is_torch_and_matches_a_loop() -> None:
    """``chunk_cat`` is ``torch._chunk_cat(tensors, 0, chunks)``, and its stand-in (each tensor cut
    along its first dimension into ``chunks`` zero-padded parts, joined per tensor) lays out the
    same values (NaN and infinities as they are, non-contiguous tensors too, into ``out`` of a
    wider dtype); ``flat_cat`` is one chunk: the tensors flattened one after the other."""
    assert tp._CHUNK_CAT is torch._chunk_cat
    xs, _ = _lists()
    xs.append(torch.randn(4, 3).t())
    for chunks in (1, 2, 4):
        want = tp._chunk_cat_loop(xs, chunks)
        assert want.shape[0] == chunks
        torch.testing.assert_close(tp.chunk_cat(xs, chunks), want, equal_nan=True)
        out = torch.empty(want.shape, dtype=torch.float64)
        torch.testing.assert_close(tp.chunk_cat(xs, chunks, out=out), want.double(), equal_nan=True)
        loop_out = torch.empty(want.shape)
        torch.testing.assert_close(tp._chunk_cat_loop(xs, chunks, out=loop_out), want, equal_nan=True)
    # element j of a tensor of n elements in (chunks, ceil(n / chunks)) rows: the third's row 1
    ragged = tp.chunk_cat([torch.arange(6.0).view(3, 2), torch.arange(5.0)], 4)
    assert ragged.tolist() == [[0, 1, 0, 1], [2, 3, 2, 3], [4, 5, 4, 0], [0, 0, 0, 0]]
    flat = torch.cat([x.reshape(-1) for x in xs])
    torch.testing.assert_close(tp.flat_cat(xs), flat, equal_nan=True)
    out = torch.empty(flat.numel() + 5)
    assert tp.flat_cat(xs, out=out[:flat.numel()]).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out[:flat.numel()], flat, equal_nan=True)


def _distributed_worker(rank: int, init: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=1, timeout=timedelta(seconds=123))
    result: dict = {"timeout": tp.default_group_timeout(), "default": dist.default_pg_timeout}
    # The public store control.py uses is the one init_process_group made.
    store = dist.group.WORLD.get_group_store()
    store.set("probe", "1")
    result["same_store"] = dist.distributed_c10d._get_default_store().get("probe") == b"1"
    mesh = init_device_mesh("cpu", (1,))
    p = nn.Parameter(distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Shard(0)]))
    shard = tp.dtensor_local(p)
    result["stable"] = tp.dtensor_local(p) is shard  # the same tensor every time
    plain = torch.ones(2)
    result["locals"] = [a is b for a, b in zip(tp.dtensor_locals([p, None, plain]), [shard, None, plain])]
    with torch.no_grad():
        public = p.to_local()
    result["same_storage"] = (public.data_ptr(), public.shape) == (shard.data_ptr(), shard.shape)
    result["leaf"] = shard.grad_fn is None and not shard.requires_grad
    result["grad_mode_is_a_node"] = p.to_local().grad_fn is not None  # why the adapter does not call to_local()
    with torch.no_grad():
        shard.mul_(2)
    result["full_after_write"] = p.full_tensor().detach().clone()
    result["degraded"] = dict(DEGRADED)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.distributed
def test_distributed_members_in_a_one_rank_gloo_group(tmp_path):
    """In a real one-rank gloo group: the timeout read back is the one given to
    ``init_process_group`` (not torch's default); DTensor's local shard is one tensor, a leaf, on the
    storage ``to_local()`` returns without grad mode (writes to it are the DTensor's)."""
    (result,) = spawn_ranks(_distributed_worker, 1, tmp_path, timeout=180)
    assert result["degraded"] == {}
    assert result["locals"] == [True, True, True]  # the list form: shards, anything else as it is
    assert result["timeout"] == timedelta(seconds=123) != result["default"]
    assert result["same_store"]
    assert result["stable"] and result["same_storage"] and result["leaf"] and result["grad_mode_is_a_node"]
    torch.testing.assert_close(result["full_after_write"], torch.arange(6.0).reshape(2, 3) * 2)


def _join_worker(rank: int, init: str, out: str) -> None:
    import logging

    from torch.distributed.algorithms.join import Join

    import trainer_agent as ta

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=1)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("trainer_agent.agent").addHandler(handler)
    agent = ta.attach(model, opt, job="join", run="join-1", config=ta.AgentConfig(metrics_port=None, report_every=1))
    seen = {"outside": tp.join_allows_uneven_inputs(model), "plain": tp.join_allows_uneven_inputs(nn.Linear(1, 1))}
    for name, throw in (("uneven", False), ("throwing", True)):
        with Join([model], throw_on_early_termination=throw):
            seen[name] = tp.join_allows_uneven_inputs(model)
            for _ in range(2):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                agent.end_step(0.0)
    seen["after"] = tp.join_allows_uneven_inputs(model)
    agent.close()
    del model
    torch.save({"seen": seen, "warnings": [w for w in warnings if "Join" in w]}, f"{out}/rank{rank}.pt")


def test_join_config_says_whether_uneven_inputs_are_allowed(tmp_path):
    """``Join`` sets it on entry and clears it on exit; inside ``Join([ddp])`` with uneven inputs
    allowed the agent warns once that Join does not shadow its report collectives."""
    (result,) = spawn_ranks(_join_worker, 1, tmp_path, timeout=180)
    assert result["seen"] == {"outside": False, "plain": False, "uneven": True, "throwing": False, "after": False}
    (warning,) = result["warnings"]
    assert "throw_on_early_termination=True" in warning


def test_fallbacks_when_a_member_is_gone(monkeypatch):
    """What each adapter does on a torch without its member: the documented stand-ins, each
    logged once (the members are taken away here by hand)."""
    from trainer_agent import compat

    monkeypatch.setattr(compat, "DEGRADED", {})
    class ScalerWithoutScale:
        def get_scale(self) -> float:
            return 256.0

    scale = tp.grad_scaler_scale(ScalerWithoutScale())  # type: ignore[arg-type]
    assert scale.item() == 256.0 and scale.dtype == torch.float64
    assert math.isnan(tp.grad_scaler_init_scale(ScalerWithoutScale()))  # type: ignore[arg-type]

    class ShardWithoutLocal:
        def to_local(self) -> torch.Tensor:
            return torch.tensor(float(torch.is_grad_enabled()))

    assert tp.dtensor_local(ShardWithoutLocal()).item() == 0.0  # read without grad mode

    monkeypatch.setattr(tp, "_NO_VERSION", True)
    t = torch.zeros(2)
    assert tp.version_counters([t]) != tp.version_counters([t])  # never equal: caches are refreshed

    monkeypatch.setattr(tp, "_NO_STEP_HOOKS", True)
    inner = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    assert tp.optimizer_has_step_hooks(inner) and not tp.optimizer_has_step_hooks(_ForwardingOptimizer(inner))
    assert sorted(compat.DEGRADED) == sorted([
        "torch.amp.GradScaler._scale", "torch.amp.GradScaler._init_scale",
        "torch.distributed.tensor.DTensor._local_tensor", "torch.Tensor._version",
        "torch.optim.Optimizer._optimizer_step_pre_hooks"])
