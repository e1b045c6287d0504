"""The whole-model screen of the fingerprints (``trainer_agent/measure/fingerprint_screen.py``) and
the two rounds built on it (``trainer_agent/report/fingerprint_rounds.py``): the screen against
the per-layer comparison it stands in for, the decision every rank takes alike, the leader's
vectors with and without the per-layer round, and the row's width against the model's depth."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer_agent.measure.fingerprint import Fingerprinter, desync, findings
from trainer_agent.measure.fingerprint_screen import Screen, screen_width
from trainer_agent.report.fingerprint_rounds import SCREEN_FRACTION, FingerprintRounds

CPU = torch.device("cpu")
TOL = 1e-5


def _model(layers: int, per_layer: int = 3, seed: int = 0) -> tuple[Fingerprinter, list[torch.Tensor]]:
    """A fingerprinter of ``layers`` layers of ``per_layer`` tensors (sizes from 7 to 9,000) and
    one rank's tensors."""
    g = torch.Generator().manual_seed(seed)
    numels = [(7, 300, 9000)[i % 3] for i in range(layers * per_layer)]
    units = torch.arange(len(numels)) // per_layer
    return (Fingerprinter(numels, units, layers, device=CPU, names=[f"blocks.{i}" for i in range(layers)]),
            [torch.randn(n, generator=g) for n in numels])


def _values(fp: Fingerprinter, grads: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([fp.layer_values([grads]), fp.layer_values([params])])


def _screens(fp: Fingerprinter, ranks: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> torch.Tensor:
    sc = Screen(fp)
    return torch.stack([sc.row(_values(fp, g, p)) for g, p in ranks])


def _per_layer_worst(fp: Fingerprinter, ranks: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> list[float]:
    rows = torch.stack([torch.stack([fp.layer_values([g]), fp.layer_values([p])]).reshape(-1) for g, p in ranks])
    vectors, _ = findings(desync(rows, fp.layers, fp.k).numpy(), len(ranks), fp.names, TOL)
    return vectors["grad_desync"]


def test_screens_of_replicas_in_sync_are_bit_identical_and_their_width_does_not_grow_with_depth() -> None:
    fp, xs = _model(6)
    ys = [x.clone() for x in xs]
    screens = _screens(fp, [(xs, xs), (ys, ys), (xs, ys)])
    assert torch.equal(screens[0], screens[1]) and torch.equal(screens[0], screens[2])
    assert torch.isfinite(screens).all()
    deep, _ = _model(131, per_layer=1)
    assert screen_width(fp) == screen_width(deep) == Screen(deep).width() == 2 * (fp.k + 1)
    assert fp.width() == 6 * (fp.k + 1) and deep.width() == 131 * (fp.k + 1)  # what a row carried before


@pytest.mark.parametrize("tensor, element", [(2, 123), (5, 4000), (1, 17)])
def test_one_element_changed_moves_the_screen_by_about_the_per_layer_difference(tensor: int, element: int) -> None:
    fp, xs = _model(3)
    layer_norm = math.sqrt(sum(float(x.double().square().sum()) for x, u in zip(xs, fp._ids_host)
                               if u == fp._ids_host[tensor]))
    bad = [x.clone() for x in xs]
    bad[tensor][element] += 1e-4 * layer_norm
    ranks = [(xs, xs), (xs, xs), (bad, xs)]
    screen = findings(Screen(fp).compare(_screens(fp, ranks)).numpy(), 3, ["set0"], TOL)[0]["grad_desync"]
    per_layer = _per_layer_worst(fp, ranks)
    assert per_layer[:2] == screen[:2] == [0.0, 0.0]
    assert per_layer[2] == pytest.approx(1e-4, rel=1e-3)
    # the norm's own change adds a term of the element's share of the layer's norm: a few percent
    assert screen[2] == pytest.approx(per_layer[2], rel=0.1)


def test_a_layer_scaled_as_a_whole_moves_the_screen_by_the_scale() -> None:
    """``f / ||x||`` does not see a layer multiplied by a factor; its log-norm term does."""
    fp, xs = _model(4)
    scaled = [x * (1 + 3e-4) if u == 2 else x for x, u in zip(xs, fp._ids_host)]
    screens = _screens(fp, [(xs, xs), (xs, xs), (scaled, xs)])
    vectors = findings(Screen(fp).compare(screens).numpy(), 3, ["set0"], TOL)[0]
    assert vectors["grad_desync"][:2] == [0.0, 0.0]
    assert vectors["grad_desync"][2] == pytest.approx(3e-4, rel=1e-2)
    assert vectors["param_desync"] == [0.0, 0.0, 0.0]


def test_a_non_finite_layer_stays_in_its_own_replica_layout() -> None:
    """With two replica layouts, a NaN in a unit of one leaves the other's sums finite."""
    fp0, xs = _model(4)
    groups = [(torch.tensor([0, 1]), torch.tensor([[0, 1, 2]])), (torch.tensor([2, 3]), torch.tensor([[0, 1, 2]]))]
    fp = Fingerprinter(fp0.numels, torch.tensor(fp0._ids_host), 4, device=CPU, groups=groups)
    sc = Screen(fp)
    assert sc.sets == 2 and sc.width() == screen_width(fp) == 2 * 2 * (fp.k + 1)
    nan = [x.clone() for x in xs]
    nan[0][0] = math.nan  # unit 0: the first layout
    row = sc.row(_values(fp, nan, xs)).view(2, 2, fp.k + 1)
    assert torch.isnan(row[0, 0]).any() and torch.isfinite(row[0, 1]).all() and torch.isfinite(row[1]).all()


def _rounds(fp: Fingerprinter, world: int = 3) -> FingerprintRounds:
    return FingerprintRounds(fp, world=world, rank=0, tol=TOL)


def _check(rounds: FingerprintRounds, screens: torch.Tensor, failed: np.ndarray) -> bool:
    """``FingerprintRounds.differ`` on host rows: the gathered screens, and fields all NaN for
    the ``failed`` ranks (a report that failed to build)."""
    fields = np.where(failed[:, None], math.nan, 0.0) * np.ones((1, 4))
    return rounds.differ(screens.numpy(), fields)


@pytest.mark.parametrize("size, differ", [(0.0, False), (1e-7, False), (SCREEN_FRACTION * TOL * 3, True), (1e-3, True)])
def test_every_rank_decides_alike_whether_the_per_layer_values_are_gathered(size: float, differ: bool) -> None:
    fp, xs = _model(3)
    bad = [x.clone() for x in xs]
    norm = math.sqrt(sum(float(x.double().square().sum()) for x, u in zip(xs, fp._ids_host) if u == 1))
    bad[4][10] += size * norm
    screens = _screens(fp, [(xs, xs), (bad, xs), (xs, xs)])
    assert _check(_rounds(fp), screens, np.zeros(3, dtype=bool)) is differ


def test_non_finite_screens_differ_only_from_finite_ones() -> None:
    fp, xs = _model(2)
    nan = [x.clone() for x in xs]
    nan[0][0] = math.nan
    rounds = _rounds(fp)
    ok = np.zeros(3, dtype=bool)
    assert not _check(rounds, _screens(fp, [(nan, xs)] * 3), ok)       # NaN everywhere (no step anywhere): alike
    assert _check(rounds, _screens(fp, [(xs, xs), (nan, xs), (xs, xs)]), ok)


def test_replica_groups_are_screened_apart() -> None:
    """Ranks 0, 1 hold one shard and 2, 3 another: their screens differ by design, not a desync."""
    fp0, xs = _model(2)
    groups = [(torch.tensor([0, 1]), torch.tensor([[0, 1], [2, 3]]))]
    fp = Fingerprinter(fp0.numels, torch.tensor(fp0._ids_host), 2, device=CPU, groups=groups)
    other = [x + 1 for x in xs]
    ranks = [(xs, xs), (xs, xs), (other, other), (other, other)]
    rounds = _rounds(fp, world=4)
    ok = np.zeros(4, dtype=bool)
    assert not _check(rounds, _screens(fp, ranks), ok)
    bad = [x.clone() for x in other]
    bad[2][5] += 1e-3
    assert _check(rounds, _screens(fp, ranks[:3] + [(bad, other)]), ok)


def test_the_leaders_vectors_are_the_per_layer_comparisons_when_the_rows_were_gathered() -> None:
    fp, xs = _model(3)
    bad = [x.clone() for x in xs]
    bad[7][3] += 0.5
    ranks = [(xs, xs), (xs, xs), (bad, xs)]
    rounds = _rounds(fp)
    screens = _screens(fp, ranks)
    detail = torch.stack([fp.row(fp.layer_values([g]), fp.layer_values([p])) for g, p in ranks])
    ok, matrix = torch.zeros(3, dtype=torch.bool), np.zeros((3, 4))
    vectors, found = rounds.decoder(8, True)(rounds.compare(screens, detail, ok).numpy(), matrix)
    rows = torch.stack([torch.stack([fp.layer_values([g]), fp.layer_values([p])]).to(torch.float32).reshape(-1)
                        for g, p in ranks])
    exact, exact_found = findings(desync(rows.double(), fp.layers, fp.k).numpy(), 3, fp.names, TOL)
    for name in ("grad_desync", "grad_desync_layer", "param_desync", "param_desync_layer"):
        np.testing.assert_allclose(vectors[name], exact[name], rtol=1e-6)
    assert vectors["grad_desync_layer"][2] == 2.0
    assert [(d.kind, d.layer, d.ranks) for d in found] == [("grad", "blocks.2", (2,))]
    assert [(d.kind, d.layer, d.ranks) for d in exact_found] == [("grad", "blocks.2", (2,))]
    # the whole-model fingerprint is the screen's, equal on the ranks in sync
    assert vectors["grad_fingerprint"][0] == vectors["grad_fingerprint"][1] != vectors["grad_fingerprint"][2]
    # without the per-layer round: the screens' values, and no layer named
    vectors, found = rounds.decoder(8, False)(rounds.compare(screens, None, ok).numpy(), matrix)
    assert found == [] and all(math.isnan(v) for v in vectors["grad_desync_layer"])
    assert vectors["grad_desync"][:2] == [0.0, 0.0] and vectors["grad_desync"][2] > TOL


def test_a_failed_report_stands_in_as_its_replica_and_gets_no_verdict() -> None:
    """Ranks 0, 1 hold one shard and 2, 3 another; rank 3's report failed (its row all NaN)."""
    fp0, xs = _model(2)
    groups = [(torch.tensor([0, 1]), torch.tensor([[0, 1], [2, 3]]))]
    fp = Fingerprinter(fp0.numels, torch.tensor(fp0._ids_host), 2, device=CPU, groups=groups)
    other = [x + 1 for x in xs]
    rounds = _rounds(fp, world=4)
    screens = _screens(fp, [(xs, xs), (xs, xs), (other, other), (other, other)])
    screens[3] = math.nan
    failed = np.array([False, False, False, True])
    matrix = np.zeros((4, 3))
    matrix[3] = math.nan
    assert not _check(rounds, screens, failed)
    assert _check(rounds, screens, np.zeros(4, dtype=bool))  # without the stand-in: NaN against numbers
    vectors, found = rounds.decoder(5, False)(rounds.compare(screens, None, torch.from_numpy(failed)).numpy(), matrix)
    assert found == []
    # rank 2 has no replica left to be compared with: no verdict either
    assert vectors["grad_desync"][:2] == [0.0, 0.0] and all(math.isnan(v) for v in vectors["grad_desync"][2:])
    # a real difference beside the failure is still seen, in the per-layer round too
    bad = [x.clone() for x in xs]
    bad[4][3] += 1e-2
    screens[1] = _screens(fp, [(bad, xs)])[0]
    assert _check(rounds, screens, failed)
    detail = torch.stack([fp.row(fp.layer_values([g]), fp.layer_values([p]))
                          for g, p in [(xs, xs), (bad, xs), (other, other), (other, other)]])
    detail[3] = math.nan
    vectors, found = rounds.decoder(5, True)(rounds.compare(screens, detail, torch.from_numpy(failed)).numpy(), matrix)
    assert [(d.kind, d.layer, d.ranks) for d in found] == [("grad", "layer1", (0, 1))]  # two replicas: both named
    assert vectors["grad_desync"][0] > TOL and vectors["grad_desync"][1] > TOL
    assert all(math.isnan(v) for v in vectors["grad_desync"][2:])


@pytest.mark.parametrize("grouped", [False, True])
def test_the_check_on_a_device_decides_as_the_check_on_the_host(grouped: bool) -> None:
    """``differ_on_device`` (NCCL's rows, run here on CPU tensors) against the host check, over
    rows in sync, a difference below and above the threshold, NaN, and a failed report."""
    fp0, xs = _model(2)
    groups = [(torch.tensor([0, 1]), torch.tensor([[0, 1], [2, 3]]))] if grouped else None
    fp = Fingerprinter(fp0.numels, torch.tensor(fp0._ids_host), 2, device=CPU, groups=groups)
    rounds = _rounds(fp, world=4)
    other = [x + 1 for x in xs] if grouped else xs
    base = [(xs, xs), (xs, xs), (other, other), (other, other)]
    norm = math.sqrt(sum(float(x.double().square().sum()) for x, u in zip(xs, fp._ids_host) if u == 1))
    cases = []
    for size in (0.0, 1e-8, 1e-4):
        bad = [x.clone() for x in xs]
        bad[4][2] += size * norm
        cases.append((_screens(fp, [base[0], (bad, xs)] + base[2:]), np.zeros(4, dtype=bool)))
    nan = _screens(fp, base)
    nan[1] = math.nan
    cases += [(nan, np.zeros(4, dtype=bool)), (nan.clone(), np.array([False, True, False, False]))]
    decisions = []
    for screens, failed in cases:
        host = _check(rounds, screens, failed)
        device = rounds.differ_on_device(screens, torch.from_numpy(failed))
        assert device.dim() == 0 and bool(device) is host
        decisions.append(host)
    assert decisions == [False, False, True, True, False]
