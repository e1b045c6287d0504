"""Element-wise fingerprints (``trainer_agent/measure/fingerprint.py``): the projections against a naive
float64 reference, the cross-rank comparison, and a real 3-rank gloo DDP run whose last rank's
all-reduced gradient (or parameter) is perturbed in one element."""

from __future__ import annotations

import gc
import math
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks
from trainer_agent.measure import fingerprint
from trainer_agent.measure.fingerprint import LARGE_ELEMENTS, Fingerprinter, desync, findings

TILE = LARGE_ELEMENTS  # from here on a tensor is laid out in LARGE_ROWS rows


def _weights(fp: Fingerprinter, i: int, n: int) -> torch.Tensor:
    """The +-1 weights of tensor ``i`` (numel ``n``) as a dense (n, K) float64 matrix: element
    ``j`` in row ``j // w`` and column ``j % w`` of its layout of ``w = ceil(n / rows)`` columns
    (16 rows below TILE elements, 4096 from there), the row's sign times the column's."""
    rows = 16 if n < TILE else 4096
    w = -(-n // rows)
    s = fp.s_for(rows, torch.float32).double()
    r = fp.r_host(i).double()
    assert s.shape == (rows, fp.k) and r.shape == (w, fp.k)
    j = torch.arange(n)
    return s[j // w] * r[j % w]


def test_projection_matches_a_naive_sum_and_moves_by_the_perturbation() -> None:
    numels = [3, TILE, 2 * TILE + 17]
    fp = Fingerprinter(numels, torch.tensor([0, 1, 1]), 2, projections=2, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, generator=g) for n in numels]
    got = fp.project(xs)
    for i, (x, n) in enumerate(zip(xs, numels)):
        w = _weights(fp, i, n)
        assert set(w.unique().tolist()) == {-1.0, 1.0}
        ref = (x.double().unsqueeze(1) * w).sum(0)
        assert torch.allclose(got[i], ref, rtol=1e-5, atol=1e-4)
    # One element changed by d: every projection moves by exactly +-d.
    d = 0.5
    ys = [x.clone() for x in xs]
    ys[2][TILE + 5] += d
    moved = (fp.project(ys) - got).abs()
    assert torch.allclose(moved[2], torch.full((2,), d, dtype=torch.float64), rtol=1e-4)
    assert moved[:2].abs().max() == 0
    # Per layer: projections summed, and the layer's L2 norm.
    per_layer = fp.layer_values([xs])
    assert torch.allclose(per_layer[1, :2], got[1] + got[2])
    assert per_layer[1, 2] == pytest.approx(math.sqrt(float(xs[1].double().square().sum() + xs[2].double().square().sum())), rel=1e-6)
    # Two fingerprinters (two ranks, two processes) draw the same weights.
    again = Fingerprinter(numels, torch.tensor([0, 1, 1]), 2, projections=2, device=torch.device("cpu"))
    assert torch.equal(again.project(xs), got)


def _rows(values: list[list[float]], norms: list[float]) -> torch.Tensor:
    """Rows of one layer, one projection: grad fingerprint f, norm; params identical (1.0, 1.0)."""
    return torch.tensor([[f, n, 1.0, 1.0] for f, n in zip(values, norms)], dtype=torch.float64).reshape(len(norms), -1)


@pytest.mark.parametrize("fs, bad, expected", [
    ([[2.0], [2.0], [2.0]], (), 0.0),
    ([[2.0], [2.0], [2.0 + 4e-4]], (2,), 1e-4),      # rel. to the layer norm 4.0
    ([[2.0], [2.0], [2.0 + 4e-7]], (), 1e-7),         # below the tolerance
    ([[2.0], [2.0 + 4e-4]], (0, 1), 1e-4),            # two ranks: nothing says which is wrong
    ([[2.0], [math.nan], [2.0]], (1,), math.inf),      # non-finite against finite
    ([[math.nan], [math.nan]], (), 0.0),               # identical (e.g. no step taken anywhere)
])
def test_desync_names_the_differing_ranks(fs, bad, expected) -> None:
    world = len(fs)
    vec = desync(_rows([f[0] for f in fs], [4.0] * world), layers=1, k=1)
    vectors, found = findings(vec.tolist(), world, ["blocks.0"], 1e-5)
    worst = max(vectors["grad_desync"])
    assert worst == pytest.approx(expected, rel=1e-3, abs=1e-12) if math.isfinite(expected) else worst == math.inf
    assert max(vectors["param_desync"]) == 0.0
    if bad:
        assert [(d.kind, d.layer, d.ranks) for d in found] == [("grad", "blocks.0", bad)]
    else:
        assert found == []


def test_desync_compares_each_replica_group_only() -> None:
    """4 ranks, two units: unit 0 replicated as HSDP 2x2 (ranks {0, 2} and {1, 3} hold the same
    shards, the pairs different ones), unit 1 replicated on every rank."""
    groups = [(torch.tensor([0]), torch.tensor([[0, 2], [1, 3]])), (torch.tensor([1]), torch.arange(4).view(1, 4))]
    unit0 = [2.0, 7.0, 2.0, 7.0 + 4e-4]          # rank 3 differs from its replica, rank 1
    unit1 = [3.0, 3.0, 3.0 + 4e-7, 3.0]          # in tolerance
    rows = torch.tensor([[unit0[r], 4.0, unit1[r], 4.0, 1.0, 1.0, 1.0, 1.0] for r in range(4)], dtype=torch.float64)
    vec = desync(rows, layers=2, k=1, groups=groups)
    vectors, found = findings(vec.tolist(), 4, ["blocks.0", "norm"], 1e-5)
    assert [(d.kind, d.layer, d.ranks) for d in found] == [("grad", "blocks.0", (1, 3))]
    assert found[0].rel_diff == pytest.approx(1e-4, rel=1e-3)
    assert vectors["grad_desync"] == pytest.approx([0.0, 1e-4, 1e-7, 1e-4], rel=1e-3, abs=1e-12)
    assert vectors["grad_desync_layer"] == [0.0, 0.0, 1.0, 0.0]
    # Compared with the whole world instead, the pairs' different shards would be a desync.
    _, everyone = findings(desync(rows, layers=2, k=1).tolist(), 4, ["blocks.0", "norm"], 1e-5)
    assert everyone[0].rel_diff > 1.0


def _naive_desync(rows: torch.Tensor, layers: int, k: int, groups) -> list[float]:
    """``desync``'s vector, one rank, unit and projection at a time in Python."""
    world = rows.shape[0]
    parts = rows.reshape(world, 2, layers, k + 1).tolist()

    def rel(a: float, ref: float, den: float) -> float:
        if a == ref or (math.isnan(a) and math.isnan(ref)):
            return 0.0
        d = abs(a - ref) / den
        return math.inf if math.isnan(d) else d

    def middle(vals: list[float]) -> tuple[float, float]:  # NaN last, like torch.sort
        s = sorted(vals, key=lambda v: (math.isnan(v), v))
        return s[(len(s) - 1) // 2], s[len(s) // 2]

    out: list[float] = []
    for kind in range(2):
        r = [[0.0] * layers for _ in range(world)]
        for units, ranks in groups:
            for members in ranks.tolist():
                for u in units.tolist():
                    den = max(middle([parts[m][kind][u][k] for m in members])[0], 1e-30)
                    mids = [middle([parts[m][kind][u][j] for m in members]) for j in range(k)]
                    for m in members:
                        r[m][u] = max(rel(parts[m][kind][u][j], ref, den) for j in range(k) for ref in mids[j])
        worst = [max(row) for row in r]
        out += worst + [float(row.index(max(row))) for row in r] + \
            [sum(parts[m][kind][u][0] for u in range(layers)) for m in range(world)] + \
            [max(r[m][u] for m in range(world)) for u in range(layers)]
    return out


def _replica_rows(world: int, layers: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    one = torch.randn(2, layers, k + 1, generator=g, dtype=torch.float64)
    one[..., k] = one[..., k].abs() + 1
    return one.reshape(1, -1).repeat(world, 1)


@pytest.mark.parametrize("case", ["in_sync", "one_bad", "two_bad_of_seven", "no_majority", "nan", "pairs",
                                  "signed_zero"])
def test_desync_on_the_host_equals_the_sorted_comparison(case: str) -> None:
    """The host path (majority by a linear pass, only differing ranks compared) gives the vector
    of the sorted comparison, whether or not most ranks agree."""
    world, layers, k = (8, 3, 2) if case in ("no_majority", "pairs") else (7, 3, 2)
    rows = _replica_rows(world, layers, k, seed=len(case))
    view = rows.view(world, 2, layers, k + 1)
    groups = None
    if case == "one_bad":
        view[5, 0, 1, 0] += 1e-3
    elif case == "two_bad_of_seven":
        view[1, 1, 2, 1] -= 0.5
        view[6, 0, 0, 2] *= 1.5  # a norm differs
    elif case == "no_majority":
        view[4:, 0, 1, 0] += 1e-2  # 4 against 4
        view[2, 1, 0, 0] += 1e-2
    elif case == "nan":
        view[:, 0, 2, 1] = math.nan  # NaN on every rank: in sync
        view[3, 1, 0, 0] = math.nan  # on one rank only: differs by inf
    elif case == "pairs":  # replica pairs (HSDP): four groups, one pair differing
        view[1::2] += 0.25  # the odd ranks hold other shards
        view[5, 0, 2, 1] += 1e-4
        groups = [(torch.arange(layers), torch.arange(world).view(4, 2))]
    elif case == "signed_zero":
        view[:, 0, 0, 0] = 0.0
        view[2, 0, 0, 0] = -0.0
    ref = _naive_desync(rows, layers, k, groups or [(torch.arange(layers), torch.arange(world).view(1, world))])
    torch.testing.assert_close(desync(rows, layers, k, groups), torch.tensor(ref, dtype=torch.float64),
                               rtol=1e-12, atol=0.0, equal_nan=True)


def test_left_out_tensors_are_neither_projected_nor_normed() -> None:
    fp = Fingerprinter([3, 5, 4], torch.tensor([0, -1, 0]), 1, projections=2, device=torch.device("cpu"))
    everything = Fingerprinter([3, 5, 4], torch.tensor([0, 1, 0]), 2, projections=2, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, generator=g) for n in (3, 5, 4)]
    assert torch.equal(fp.layer_values([xs]), everything.layer_values([xs])[:1])
    only_first = fp.layer_values([xs], skip={2})
    assert torch.equal(only_first[0, :2], everything.project([xs[0]] + [torch.zeros(())] * 2)[0])
    assert only_first[0, 2] == pytest.approx(float(xs[0].double().norm()), rel=1e-6)


def _per_tensor_layer_values(fp: Fingerprinter, xs: list[torch.Tensor], units: list[int],
                             skip: set[int] = frozenset()) -> torch.Tensor:
    """Reference for ``layer_values``: one projection per tensor (``project_one``), summed per
    unit in float64; the norms in float64."""
    out = torch.zeros(fp.layers, fp.k + 1, dtype=torch.float64)
    for i, x in enumerate(xs):
        if units[i] < 0 or i in skip:
            continue
        out[units[i], :fp.k] += fp.project_one(i, x)
        out[units[i], fp.k] += float(x.double().square().sum())
    out[:, fp.k].sqrt_()
    return out


def _by_dtype(xs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = []
    for x in xs:
        if buckets and buckets[-1][-1].dtype == x.dtype:
            buckets[-1].append(x)
        else:
            buckets.append([x])
    return buckets


# Every layout the staged chunks have: small tensors (16 rows) of several widths, one whose first
# dimension 16 divides (copied as it is) and others (flattened), a tensor of exactly TILE elements
# and larger ones (4096 rows), padded and not, a non-contiguous one, a bf16 one, a float64 one
# (projected in place), a left-out one.
FUSED_SHAPES = [(3,), (17,), (20, 20), (64, 64), (TILE + 5,), (3 * TILE + 100,), (1,), (64, 32), (2049,),
                (50, 100), (7, 9)]
FUSED_UNITS = [0, 1, 1, 2, 2, 0, -1, 3, 3, 1, 3]


def _fused_inputs() -> tuple[Fingerprinter, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(s, generator=g) for s in FUSED_SHAPES]
    xs[7] = xs[7].t()  # (32, 64), not contiguous
    xs[9] = xs[9].to(torch.bfloat16)
    xs[10] = xs[10].double()
    numels = [x.numel() for x in xs]
    return Fingerprinter(numels, torch.tensor(FUSED_UNITS), 4, device=torch.device("cpu")), xs


def test_fused_layer_values_equal_the_per_tensor_projections() -> None:
    fp, xs = _fused_inputs()
    ref = _per_tensor_layer_values(fp, xs, FUSED_UNITS)
    got = fp.layer_values(_by_dtype(xs))
    # The same weights summed in another order: float32 rounding apart, the same values.
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-3 * float(ref[:, 2].max()) * 1e-3)
    # One element changed by d moves the unit's projections by +-d, and no other unit's.
    ys = [x.clone() for x in xs]
    ys[5][2 * TILE + 3] += 0.25  # a full row (weight s)
    ys[8][2048] -= 0.5  # the tail of a tensor just over half a row
    moved = (fp.layer_values(_by_dtype(ys)) - got)[:, :2].abs()
    assert torch.allclose(moved[0], torch.full((2,), 0.25, dtype=torch.float64), rtol=1e-3)
    assert torch.allclose(moved[3], torch.full((2,), 0.5, dtype=torch.float64), rtol=1e-3)
    assert moved[1:3].max() == 0
    # Staged again (the buffer keeps its padding at 0): bit-identical, like a replica in sync.
    assert torch.equal(fp.layer_values(_by_dtype(xs)), got)
    again, _ = _fused_inputs()
    assert torch.equal(again.layer_values(_by_dtype(xs)), got)


def test_fused_layer_values_leave_out_missing_and_skipped_tensors(monkeypatch) -> None:
    fp, xs = _fused_inputs()
    every = fp.layer_values(_by_dtype(xs))  # the buffer now holds every tensor
    assert torch.equal(fp.layer_values(_by_dtype(xs)), every)  # again, through the staging views kept
    missing = list(xs)
    missing[4] = torch.zeros(())  # a parameter without a gradient: its 0-dim stand-in
    units = list(FUSED_UNITS)
    ref = _per_tensor_layer_values(fp, missing, [u if i != 4 else -1 for i, u in enumerate(units)])
    assert torch.allclose(fp.layer_values(_by_dtype(missing)), ref, rtol=1e-5, atol=1e-4)
    ref = _per_tensor_layer_values(fp, xs, units, skip={3, 5, 10})
    assert torch.allclose(fp.layer_values(_by_dtype(xs), skip={3, 5, 10}), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(fp.layer_values(_by_dtype(xs)), every)  # every tensor again: the kept views
    # A small buffer: the small float32 tensors in several chunks, the 3*TILE+100 tensor projected
    # in place (as the float64 one always is); same values.
    monkeypatch.setattr(fingerprint, "STAGE_ELEMENTS", 2000)
    monkeypatch.setattr(fingerprint, "DIRECT_ELEMENTS", 2 * TILE)
    chunked = Fingerprinter([x.numel() for x in xs], torch.tensor(FUSED_UNITS), 4, device=torch.device("cpu"))
    got = chunked.layer_values(_by_dtype(xs))
    plan = chunked._stage(xs)
    assert len([c for c in plan.chunks if c.rows == 16 and c.dtype == torch.float32]) > 1
    assert plan.direct == [5, 10]
    assert torch.allclose(got, _per_tensor_layer_values(chunked, xs, units), rtol=1e-5, atol=1e-4)


def test_settled_buckets_are_projected_from_their_layouts(monkeypatch) -> None:
    """Buckets tagged with their settled layouts (``staged.Settled``: the index's parameters and
    their gradients) are projected with a plan made from the layouts, the same values as the
    per-tensor projections and as untagged buckets, the non-contiguous tensor flattened in logical
    order all the same; no tensor's shape is read for it. A bucket cast to another dtype is
    projected from its own shapes and dtypes."""
    from trainer_agent.measure import staged

    fp, xs = _fused_inputs()
    ref = _per_tensor_layer_values(fp, xs, FUSED_UNITS)
    buckets = _by_dtype(xs)
    settled = [staged.Settled(b, staged.Layout(b)) for b in buckets]
    plain = fp.layer_values(buckets)
    assert torch.allclose(plain, ref, rtol=1e-5, atol=1e-4)

    class Blind(torch.Tensor):  # a read of .shape fails the test
        @property
        def shape(self):
            raise AssertionError("shape read")

    def blind(t: torch.Tensor) -> torch.Tensor:
        return t.as_subclass(Blind) if t.dtype == torch.float32 and t.numel() < 4096 else t
    got = fp.layer_values(settled)
    assert torch.equal(got, plain)
    monkeypatch.setattr(staged, "PLAIN", (torch.Tensor, torch.nn.Parameter, Blind))
    hidden = [staged.Settled([blind(t) for t in b], b.layout) for b in settled]
    sq = torch.stack([x.double().square().sum() for x in xs])  # (bucket_norms would read the shapes)
    assert torch.equal(fp.layer_values(hidden, sq=sq), fp.layer_values(buckets, sq=sq))
    cast = [staged.Settled([t.double() for t in b], b.layout) if b[0].dtype == torch.float32 else b for b in settled]
    assert torch.allclose(fp.layer_values(cast), plain, rtol=1e-5, atol=1e-4)


def test_fused_layer_values_dispatch_a_constant_number_of_operators() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for tensors in (10, 1000):
        g = torch.Generator().manual_seed(tensors)
        xs = [torch.randn(20_000 // tensors, generator=g) for _ in range(tensors)]
        units = torch.arange(tensors) // 5
        fp = Fingerprinter([x.numel() for x in xs], units, int(units.max()) + 1, device=torch.device("cpu"))
        fp.layer_values([xs])  # first use: the plan and the buffer's views
        Count.ops = 0
        with Count():
            fp.layer_values([xs])
        counts.append(Count.ops)
    assert counts[0] == counts[1] < 20


WORLD = 3
# (step, what rank 2 perturbs, relative size): reports every 2 steps.
PLAN = {4: ("grad", 1e-7), 6: ("grad", 1e-4), 8: ("param", 1e-4)}
STEPS = 12


def _ddp_rank(rank: int, world: int, init: str, model: nn.Module, run: str, **config):  # type: ignore[no-untyped-def]
    """This rank's DDP model, SGD and agent (``config``: the AgentConfig's settings)."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import trainer_agent as ta

    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    return ddp, opt, ta.attach(ddp, opt, job="fp", run=run, config=ta.AgentConfig(metrics_port=None, **config))


def _save(agent, ddp, rank: int, out: str, seen: dict) -> None:  # type: ignore[no-untyped-def]
    """The run's end on this rank: how many per-layer rounds it took part in, ``seen`` saved."""
    seen["detailed"] = agent.reports.rounds.detailed
    agent.close()
    del agent, ddp
    gc.collect()
    dist.destroy_process_group()
    torch.save(seen, f"{out}/rank{rank}.pt")


def _worker(rank: int, init: str, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(80, 64), nn.Tanh(), nn.Linear(64, 80))  # 5120 > TILE weights
    ddp, opt, agent = _ddp_rank(rank, WORLD, init, model, "fp-1", report_every=2, layer_depth=1)
    seen = {}
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 80, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = ddp(x).square().mean()
        loss.backward()
        what = PLAN.get(step)
        if rank == WORLD - 1 and what is not None and what[0] == "grad":
            layer = [p.grad for p in model[2].parameters()]
            norm = math.sqrt(sum(float(g.double().square().sum()) for g in layer))
            model[2].weight.grad[7, 3] += what[1] * norm
        opt.step()
        if rank == WORLD - 1 and what is not None and what[0] == "param":
            with torch.no_grad():
                norm = math.sqrt(sum(float(p.double().square().sum()) for p in model[0].parameters()))
                model[0].weight[1, 2] += what[1] * norm
        opt.zero_grad()
        agent.end_step(loss)
        if step % 2 == 0:
            agent.latest()
            # The leader compares; the other ranks do none of it (no findings, no desync vectors).
            seen[step] = ([(d.kind, d.layer, d.ranks, d.rel_diff) for d in agent.desync],
                          {k: agent.rank_values.get(k) for k in ("grad_desync", "param_desync", "grad_fingerprint",
                                                                 "grad_desync_layer")})
    _save(agent, ddp, rank, out, seen)


@pytest.mark.distributed
def test_ddp_perturbed_rank_and_layer_are_named(tmp_path) -> None:
    out = spawn_ranks(_worker, WORLD, tmp_path, timeout=120)
    for seen in out[1:]:  # only the leader compares the gathered fingerprints
        assert seen.pop("detailed") == 4   # every rank takes part in the same detail rounds
        assert all(found == [] and set(vectors.values()) == {None} for found, vectors in seen.values())
    seen = out[0]
    # Per-layer rows gathered at steps 6, 8, 10 and 12, when a rank's whole-model screen differed; not
    # while in sync (steps 2 and 4: the 1e-7 difference is below the screen's threshold).
    assert seen.pop("detailed") == 4
    assert seen[2][0] == []                                   # in sync: bit-identical
    assert set(seen[2][1]["grad_desync"]) == {0.0}
    assert len(set(seen[2][1]["grad_fingerprint"])) == 1
    assert all(math.isnan(v) for v in seen[2][1]["grad_desync_layer"])  # no layer compared
    assert seen[4][0] == []                                   # 1e-7 of the layer's norm: in tolerance
    assert 0 < max(seen[4][1]["grad_desync"]) < 1e-5
    (kind, layer, ranks, rel), *rest = seen[6][0]             # 1e-4: found, rank and layer named
    assert (kind, layer, ranks) == ("grad", "2", (2,))
    assert rel == pytest.approx(1e-4, rel=1e-2)
    assert [d for d in rest if d[0] == "grad"] == []
    assert seen[6][1]["grad_desync"][:2] == [0.0, 0.0]        # the per-layer comparison's values
    assert seen[6][1]["grad_desync"][2] == pytest.approx(1e-4, rel=1e-2)
    assert seen[6][1]["grad_desync_layer"][2] == 1.0           # the index of "2" among the layers "0", "2"
    params = [d for d in seen[8][0] if d[0] == "param"]
    assert [d[:3] for d in params] == [("param", "0", (2,))]
    assert params[0][3] == pytest.approx(1e-4, rel=1e-2)
    assert seen[8][1]["grad_desync"] == [0.0, 0.0, 0.0]      # step 8's gradients agree again
    # The parameters stay apart: every later report compares them layer by layer.
    assert [d[:3] for d in seen[12][0]] == [("param", "0", (2,))]


def _closure_worker(rank: int, init: str, out: str) -> None:
    """``opt.step(closure)`` (Lightning's way): the last rank's gradient is moved after the
    closure's backward pass at step 4 (a report step) and step 5 (an ordinary one)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 8))
    ddp, opt, agent = _ddp_rank(rank, WORLD, init, model, "fp-closure", report_every=2, layer_depth=1)
    seen = {}
    for step in range(1, 7):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))

        def closure(x=x, step=step):  # type: ignore[no-untyped-def]
            opt.zero_grad()
            loss = ddp(x).square().mean()
            loss.backward()
            if rank == WORLD - 1 and step in (4, 5):
                model[2].weight.grad[3, 1] += 1e-2 * float(model[2].weight.grad.norm())
            return loss

        agent.end_step(opt.step(closure).detach())
        if step % 2 == 0:
            agent.latest()
            seen[step] = [(d.kind, d.layer, d.ranks) for d in agent.desync]
    _save(agent, ddp, rank, out, seen)


@pytest.mark.distributed
def test_a_closure_steps_gradient_fingerprint_is_its_own(tmp_path) -> None:
    """The optimizer's pre-step hook runs before the closure: the fingerprints read there were the
    last step's gradients (step 4's moved gradient went unseen, step 5's was named at step 6)."""
    seen = spawn_ranks(_closure_worker, WORLD, tmp_path, timeout=120)[0]
    assert seen.pop("detailed") >= 1
    grads = {step: [d for d in found if d[0] == "grad"] for step, found in seen.items()}
    assert grads == {2: [], 4: [("grad", "2", (WORLD - 1,))], 6: []}


def _failing_worker(world: int, rank: int, init: str, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ddp, opt, agent = _ddp_rank(rank, world, init, model, "fp-fail", report_every=1)
    seen = {}
    for step in range(1, 5):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = ddp(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 1 and step == 3:  # an error in the agent on this rank while it builds the report
            def boom(*args, **kwargs):  # type: ignore[no-untyped-def]
                raise RuntimeError("injected: this rank's report could not be built")

            agent.reports._rank_fields, kept = boom, agent.reports._rank_fields
        agent.end_step(loss)
        if rank == 1 and step == 3:
            agent.reports._rank_fields = kept
        latest = agent.latest()
        seen[step] = ({k: agent.rank_values.get(k) for k in ("grad_desync", "param_desync", "loss")},
                      [(d.kind, d.layer, d.ranks) for d in agent.desync], latest["trainguard_agent_errors_total"])
    _save(agent, ddp, rank, out, seen)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_whose_report_failed_is_no_desync(world: int, tmp_path) -> None:
    """A rank whose report fails to build sends a row of NaN. Its fingerprints stand in as a
    healthy replica's: no rank reads as desynchronised (two ranks: neither), no per-layer round
    is gathered for it, and the leader reports no verdict (NaN) where nothing could be compared."""
    out = spawn_ranks(partial(_failing_worker, world), world, tmp_path, timeout=120)
    assert [seen.pop("detailed") for seen in out] == [0] * world
    assert out[1][3][2] >= 1 and out[0][3][2] == 0            # the error counted where it happened
    vectors, found, _ = out[0][3]
    assert found == []
    assert math.isnan(vectors["loss"][1])                      # the failed rank's row
    expected = [math.nan, math.nan] if world == 2 else [0.0, math.nan, 0.0]  # two ranks: nothing to compare
    for kind in ("grad_desync", "param_desync"):
        assert [math.isnan(v) for v in vectors[kind]] == [math.isnan(v) for v in expected]
        assert [v for v in vectors[kind] if not math.isnan(v)] == [v for v in expected if not math.isnan(v)]
    for step in (1, 2, 4):                                     # before and after: compared as ever
        assert out[0][step][0]["grad_desync"] == [0.0] * world and out[0][step][1] == []


# ---------------------------------------------------------------- sharded parameters (DTensors)
# Under HSDP (mesh 2x2: replicate x shard) and tensor parallel (2 ranks) only the replicas of a
# shard are compared. The plan perturbs, on one rank, the local gradient of layer "3" (reduced
# over the replicas: the same on every replica) and then the local parameter of layer "0" (the
# LayerNorm), each by a size relative to the norm of the layer's replicated local tensors.
SHARDED_PLAN = {2: ("grad", 1e-7), 3: ("grad", 1e-4), 4: ("param", 1e-7), 5: ("param", 1e-4)}
# The perturbing rank and the ranks holding the same shards as it (the mesh's replicate groups).
SHARDED = {"hsdp": (4, 3, (1, 3)), "tp": (2, 1, (0, 1))}


def _sharded_model(mode: str, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[1], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:  # the norm's weight and bias and the row-wise layer's bias are replicated DTensors
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)),
                                         "3": RowwiseParallel()})
    return model


def _replicated_locals(mode: str, layer: nn.Module) -> list[torch.Tensor]:
    """The local tensors of ``layer`` that the ranks' replicas share: under HSDP every parameter
    (replicated along the replicate dimension), under TP those replicated on the whole mesh."""
    return [p._local_tensor for p in layer.parameters()
            if mode == "hsdp" or not any(pl.is_shard() for pl in p.placements)]


def _sharded_worker(mode: str, rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    world, bad_rank, _ = SHARDED[mode]
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import trainer_agent as ta

    model = _sharded_model(mode, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="fp", run=f"fp-{mode}",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, layer_depth=1))
    # Pre-flight: the replicas start from the same parameters; then one rank's norm weight moved
    # by 1e-3 of the layer (restored afterwards) must fail the check, naming the layer.
    x0 = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(rank))
    checks = {"clean": agent.preflight(x0, loss_fn=lambda m, b: m(b).square().mean(), clip_grad_norm=None)}
    weight = model[0].weight._local_tensor
    kept = weight[1].clone()
    if rank == bad_rank:
        norm = math.sqrt(sum(float(t.double().square().sum()) for t in _replicated_locals(mode, model[0])))
        with torch.no_grad():
            weight[1] += 1e-3 * norm
    checks["moved"] = agent.preflight(x0, loss_fn=lambda m, b: m(b).square().mean(), clip_grad_norm=None)
    with torch.no_grad():
        weight[1] = kept
    seen = {0: {k: next((c.status, c.values) for c in r.checks if c.name == "ranks_agree")
                for k, r in checks.items()}}
    for step in range(1, 6):
        # Each rank its own batch (data parallelism; under TP its own part of the sequence).
        x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        what = SHARDED_PLAN.get(step)
        with torch.no_grad():
            if rank == bad_rank and what is not None and what[0] == "grad":
                grads = [p.grad for p in model[3].parameters()
                         if mode == "hsdp" or not any(pl.is_shard() for pl in p.placements)]
                norm = math.sqrt(sum(float(g._local_tensor.double().square().sum()) for g in grads))
                model[3].bias.grad._local_tensor[1] += what[1] * norm
            opt.step()
            if rank == bad_rank and what is not None and what[0] == "param":
                norm = math.sqrt(sum(float(t.double().square().sum()) for t in _replicated_locals(mode, model[0])))
                model[0].weight._local_tensor[1] += what[1] * norm
        opt.zero_grad()
        agent.end_step(loss)
        latest = agent.latest()
        seen[step] = ([(d.kind, d.layer, d.ranks, d.rel_diff) for d in agent.desync],
                      {k: agent.rank_values.get(k) for k in ("grad_desync", "param_desync", "grad_fingerprint",
                                                             "param_fingerprint")},
                      latest["trainguard_agent_errors_total"])
    agent.close()
    del agent, model, opt
    gc.collect()
    dist.destroy_process_group()
    torch.save(seen, f"{out}/rank{rank}.pt")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["tp", "hsdp"])
def test_sharded_replicas_perturbed_rank_and_layer_are_named(mode: str, tmp_path) -> None:
    world, bad_rank, group = SHARDED[mode]
    out = spawn_ranks(partial(_sharded_worker, mode), world, tmp_path, timeout=240)
    for seen in out[1:]:  # only the leader compares the gathered fingerprints (the pre-flight: every rank)
        assert seen[0] == out[0][0]
        assert all(seen[step][0] == [] and set(seen[step][1].values()) == {None} for step in seen if step)
    seen = out[0]
    pre = seen.pop(0)
    assert pre["clean"][0] == "pass"
    assert pre["moved"][0] == "fail"
    assert [(d["kind"], d["layer"], tuple(d["ranks"])) for d in pre["moved"][1]["layers"]] == [("param", "0", group)]
    assert {errors for _, _, errors in seen.values()} == {0.0}
    found, vectors, _ = seen[1]                               # in sync: the replicas bit-identical
    assert found == []
    assert set(vectors["grad_desync"]) == set(vectors["param_desync"]) == {0.0}
    for kind in ("grad_fingerprint", "param_fingerprint"):
        assert len({vectors[kind][r] for r in group}) == 1
        if mode == "hsdp":  # the other replica pair holds the other shards: different values
            assert vectors[kind][0] != vectors[kind][1]
    assert seen[2][0] == []                                   # 1e-7 of the layer: in tolerance
    assert 0 < max(seen[2][1]["grad_desync"]) < 1e-5
    grads = [d for d in seen[3][0] if d[0] == "grad"]          # 1e-4: found, ranks and layer named
    assert [d[:3] for d in grads] == [("grad", "3", group)]   # two replicas: nothing says which
    assert grads[0][3] == pytest.approx(1e-4, rel=1e-2)
    assert bad_rank in group
    others = [r for r in range(world) if r not in group]
    assert all(seen[3][1]["grad_desync"][r] == 0.0 for r in others)
    assert [d for d in seen[4][0] if d[1] == "0"] == []       # the norm's 1e-7: in tolerance
    params = [d for d in seen[5][0] if d[:2] == ("param", "0")]
    assert [d[:3] for d in params] == [("param", "0", group)]
    assert params[0][3] == pytest.approx(1e-4, rel=1e-2)
    assert all(seen[5][1]["param_desync"][r] == 0.0 for r in others)


def test_a_plan_made_while_a_gradient_is_missing_serves_every_later_report() -> None:
    """The fused plan is made at first use: where a gradient is missing then (a 0-dim stand-in of
    the same dtype), its tensor is still laid out at its full size, projected as zeros that time
    and as itself once present, without and with shapes the plan did not see (a flattened view)."""
    fp, xs = _fused_inputs()
    xs[7] = xs[7].contiguous()  # every tensor of the chunk contiguous: the plan's fast path
    missing = list(xs)
    missing[2] = torch.zeros(())  # (20, 20) float32, like its neighbours: the same plan
    units = list(FUSED_UNITS)
    ref = _per_tensor_layer_values(fp, missing, [u if i != 2 else -1 for i, u in enumerate(units)])
    assert torch.allclose(fp.layer_values(_by_dtype(missing)), ref, rtol=1e-5, atol=1e-4)
    for present in (xs, [x.reshape(-1) if i == 2 else x for i, x in enumerate(xs)]):
        ref = _per_tensor_layer_values(fp, present, units)
        assert torch.allclose(fp.layer_values(_by_dtype(present)), ref, rtol=1e-5, atol=1e-4)
