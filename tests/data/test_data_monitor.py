"""DataMonitor signals against independent computations (naive loops in float64, scipy), and its
settings: bad argument types give ValueError (the library's contract), not TypeError."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from scipy import stats

from trainer_agent.data import DataMonitor, ks_2samp

DUP = "trainguard_data_duplicate_ratio"
NEAR = "trainguard_data_near_duplicate_ratio"
KL = "trainguard_data_token_kl_divergence"
SPECIAL = "trainguard_data_special_token_ratio"
PVALUE = "trainguard_data_length_shift_pvalue"


def naive_duplicate_ratio(seqs: list[tuple[int, ...]], window: int) -> float:
    """Share of the last `window` sequences whose content occurs earlier among them."""
    win = seqs[-window:]
    dup = sum(1 for i, s in enumerate(win) if s in win[:i])
    return dup / len(win)


def padded(seqs: list[list[int]], width: int, left: bool, pad: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(seqs), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, sl] = torch.tensor(s)
        mask[i, sl] = 1
    return ids, mask


def test_duplicate_ratio_exact_count_with_padding_and_eviction():
    rng = np.random.default_rng(0)
    pool = [list(rng.integers(0, 500, rng.integers(3, 30))) for _ in range(60)]
    window = 50
    monitor = DataMonitor(500, window=window, reference_tokens=10**9, near_duplicates=False)
    seen: list[tuple[int, ...]] = []
    for step in range(40):
        # Draw from a small pool so duplicates occur, some inside the window, some only across it.
        batch = [pool[i] for i in rng.integers(0, len(pool), 4)]
        ids, mask = padded(batch, 32, left=step % 2 == 0)
        monitor.observe_batch(ids, mask)
        seen.extend(tuple(int(t) for t in s) for s in batch)
        expected = naive_duplicate_ratio(seen, window)
        assert monitor.values()[DUP] == pytest.approx(expected, abs=1e-12)
    # The stream really exercised both cases.
    assert naive_duplicate_ratio(seen, window) > 0
    assert naive_duplicate_ratio(seen, window) < naive_duplicate_ratio(seen, len(seen))


def test_duplicate_that_left_the_window_is_not_a_duplicate():
    monitor = DataMonitor(100, window=4, near_duplicates=False)
    a, b, c, d, e = ([i, i + 1, i + 2] for i in range(0, 50, 10))
    for seq in (a, b, c, d):
        monitor.observe_batch(torch.tensor(seq))
    assert monitor.values()[DUP] == 0.0
    monitor.observe_batch(torch.tensor(e))   # window: b c d e
    monitor.observe_batch(torch.tensor(a))   # window: c d e a -- the first `a` has left
    assert monitor.values()[DUP] == 0.0
    monitor.observe_batch(torch.tensor(a))   # window: d e a a
    assert monitor.values()[DUP] == 0.25
    monitor.observe_batch(torch.tensor([a, a]))  # window: a a a a (a batch larger than one)
    assert monitor.values()[DUP] == 0.75


def test_near_duplicates_flag_edited_copies_not_distinct_sequences():
    rng = np.random.default_rng(1)
    base = [rng.integers(0, 50_000, 2048) for _ in range(20)]
    edited = []
    for s in base[:10]:
        t = s.copy()
        t[rng.integers(0, 2048)] = (t[0] + 1) % 50_000  # one token changed: Jaccard ~0.995
        edited.append(t)
    monitor = DataMonitor(50_000, window=1000)
    monitor.observe_batch(np.stack(base))
    v = monitor.values()
    assert v[NEAR] == 0.0 and v[DUP] == 0.0
    monitor.observe_batch(np.stack(edited))
    v = monitor.values()
    assert v[DUP] == 0.0
    assert v[NEAR] == pytest.approx(10 / 30)
    monitor.observe_batch(np.stack(base[15:]))  # exact copies are near-duplicates too
    v = monitor.values()
    assert v[DUP] == pytest.approx(5 / 35) and v[NEAR] == pytest.approx(15 / 35)


def test_short_sequences_are_near_duplicates_only_when_identical():
    monitor = DataMonitor(100, window=100)
    monitor.observe_batch(torch.tensor([[1, 2], [3, 4], [1, 2], [5, 6]]))
    v = monitor.values()
    assert v[DUP] == 0.25 and v[NEAR] == 0.25


def smoothed(p: np.ndarray, eps: float) -> np.ndarray:
    return (p + eps) / (1 + p.size * eps)


def kl_by_hand(window_tokens: list[int], ref_p: np.ndarray, eps: float) -> float:
    counts = Counter(window_tokens)
    n = len(window_tokens)
    total = 0.0
    for i in range(ref_p.size):
        p = (counts.get(i, 0) / n + eps) / (1 + ref_p.size * eps)
        r = (ref_p[i] + eps) / (1 + ref_p.size * eps)
        total += p * math.log(p / r)
    return total


@pytest.mark.parametrize("as_counts", [True, False])
def test_kl_against_given_reference_over_the_window(as_counts):
    vocab, eps = 64, 1e-6
    rng = np.random.default_rng(2)
    ref_counts = rng.integers(0, 1000, vocab).astype(np.float64)
    ref_counts[5] = 0  # a token absent from the reference: smoothing keeps KL finite
    ref_p = ref_counts / ref_counts.sum()
    monitor = DataMonitor(vocab, window=6, reference=ref_counts if as_counts else ref_p, kl_epsilon=eps)
    assert KL not in monitor.values()
    shifted = np.roll(ref_p, 7) * 0.5 + 0.5 / vocab  # a known shift of the distribution
    seqs: list[list[int]] = []
    for _ in range(5):
        batch = [list(rng.choice(vocab, size=int(rng.integers(5, 40)), p=shifted)) for _ in range(3)]
        seqs.extend(batch)
        ids, mask = padded(batch, 40, left=False)
        monitor.observe_batch(ids, mask)
        window_tokens = [t for s in seqs[-6:] for t in s]
        assert monitor.values()[KL] == pytest.approx(kl_by_hand(window_tokens, ref_p, eps), rel=1e-9)
    assert monitor.values()[KL] > 0.1


def test_kl_reference_frozen_from_first_tokens():
    vocab, eps = 32, 1e-6
    rng = np.random.default_rng(3)
    stream = rng.integers(0, vocab, (6, 10))
    stream[3:] = rng.integers(0, 8, (3, 10))  # later data collapses onto 8 ids
    monitor = DataMonitor(vocab, window=2, reference_tokens=25, kl_epsilon=eps)
    monitor.observe_batch(stream[0:2])
    assert KL not in monitor.values()  # 20 < 25 tokens seen
    monitor.observe_batch(stream[2:4])  # the reference is frozen in the middle of this batch
    ref = np.bincount(stream.reshape(-1)[:25], minlength=vocab) / 25
    v = monitor.values()
    assert v[KL] == pytest.approx(kl_by_hand(list(stream[2:4].reshape(-1)), ref, eps), rel=1e-9)
    monitor.observe_batch(stream[4:6])
    assert monitor.values()[KL] == pytest.approx(kl_by_hand(list(stream[4:6].reshape(-1)), ref, eps), rel=1e-9)


@pytest.mark.parametrize("reference", [np.ones(9), np.array([1, -1, 1]), np.array([1.0, math.nan, 1.0]),
                                       np.zeros(3), np.array([1.0, math.inf, 0.0])])
def test_bad_reference_is_refused(reference):
    with pytest.raises(ValueError, match="reference"):
        DataMonitor(3, reference=reference)


def test_special_token_ratio_over_the_window():
    monitor = DataMonitor(1000, special_ids=(0, 3), window=3, near_duplicates=False)
    assert SPECIAL not in monitor.values()
    seqs = [[0, 5, 6, 7], [8, 9, 3, 3, 0, 10], [11, 12], [13, 14, 15, 16, 17]]
    ids, mask = padded(seqs, 6, left=True, pad=0)  # padding id 0 is special, but masked out
    monitor.observe_batch(ids[:3], mask[:3])
    assert monitor.values()[SPECIAL] == pytest.approx(4 / 12)
    monitor.observe_batch(ids[3:], mask[3:])  # the first sequence leaves the window
    assert monitor.values()[SPECIAL] == pytest.approx(3 / 13)
    assert DataMonitor(10).values().get(SPECIAL) is None  # no special ids: absent


def test_length_pvalue_matches_scipy_and_waits_for_enough_sequences():
    rng = np.random.default_rng(4)
    monitor = DataMonitor(100, window=120, length_reference=80, min_length_samples=30, near_duplicates=False)
    ref = rng.integers(5, 30, 80)
    cur = rng.integers(10, 40, 100)  # shifted, many ties

    def feed(lengths):
        mask = np.arange(40)[None, :] < lengths[:, None]
        monitor.observe_batch(np.ones((lengths.size, 40), dtype=np.int32), mask)

    feed(ref[:50])
    assert PVALUE not in monitor.values()
    feed(np.concatenate([ref[50:], cur[:29]]))  # reference complete, 29 < 30 current sequences
    assert PVALUE not in monitor.values()
    feed(cur[29:30])
    assert monitor.values()[PVALUE] == pytest.approx(stats.ks_2samp(ref, cur[:30]).pvalue, abs=1e-9)
    feed(cur[30:])  # the current window is the last 120 sequences, but only those after the reference
    expected = stats.ks_2samp(ref, cur).pvalue
    assert monitor.values()[PVALUE] == pytest.approx(expected, abs=1e-9)
    assert expected < 0.05


@pytest.mark.parametrize("n1,n2", [(30, 30), (50, 73), (200, 200), (999, 1001), (1500, 2500)])
def test_ks_2samp_with_ties_against_scipy(n1, n2):
    rng = np.random.default_rng(n1 + n2)
    for shift in (0, 1, 3):
        x, y = rng.integers(0, 25, n1), rng.integers(shift, 25 + shift, n2)
        d, p = ks_2samp(x, y)
        ref = stats.ks_2samp(x, y, method="exact" if n1 * n2 <= 1_000_000 else "asymp")
        assert d == pytest.approx(ref.statistic, abs=1e-12)
        assert p == pytest.approx(ref.pvalue, abs=1e-6 if n1 * n2 <= 1_000_000 else 5e-3)
    assert ks_2samp(np.full(40, 7), np.full(50, 7)) == (0.0, 1.0)


def test_inputs_dtypes_shapes_and_devices_agree():
    rng = np.random.default_rng(5)
    data = rng.integers(0, 120, (4, 16))
    results = []
    for ids in (torch.tensor(data, dtype=torch.int64), torch.tensor(data, dtype=torch.int32),
                torch.tensor(data, dtype=torch.uint8), torch.tensor(data, dtype=torch.int16),
                data.astype(np.uint16), data.astype(np.int8), data.tolist()):
        m = DataMonitor(128, special_ids=(1,), window=10, reference_tokens=32)
        m.observe_batch(ids)
        results.append(m.values())
    assert all(r == results[0] for r in results)
    one = DataMonitor(128, special_ids=(1,), window=10, reference_tokens=32)
    for row in data:  # 1-D: one sequence per call
        one.observe_batch(torch.tensor(row))
    assert one.values() == results[0]
    pad = DataMonitor(128, special_ids=(1,), window=10, reference_tokens=32, pad_id=127)
    pad.observe_batch(np.concatenate([data, np.full((4, 3), 127)], axis=1))
    assert pad.values() == results[0]


@pytest.mark.parametrize("ids,mask,match", [
    (torch.zeros(0, dtype=torch.int64), None, "empty batch"),
    (torch.zeros((2, 0), dtype=torch.int64), None, "empty batch"),
    (torch.tensor([[1, 2]]), torch.tensor([[0, 0]]), "no non-padding"),
    (torch.tensor([1.0, 2.0]), None, "integers"),
    (torch.tensor([True, False]), None, "integers"),
    (np.array([1.5]), None, "integers"),
    (torch.tensor([1, 128]), None, "outside the vocabulary"),
    (torch.tensor([-1, 2]), None, "outside the vocabulary"),
    (torch.zeros((1, 2, 3), dtype=torch.int64), None, "1-D"),
    (torch.tensor([[1, 2]]), torch.tensor([[1, 1, 1]]), "shape"),
    (torch.tensor([[1, 2]]), torch.tensor([[1.0, 1.0]]), "attention_mask"),
    # Each of these raised numpy's or torch's own error (TypeError, NotImplementedError) or a
    # message that did not say what to pass.
    ({"input_ids": torch.tensor([[1, 2]])}, None, "got a dict; pass its 'input_ids'"),
    ([[1, 2], [3]], None, "rows of one length"),
    (torch.zeros((2, 3), dtype=torch.int64, device="meta"), None, "dense tensor with data"),
    (torch.tensor([[1, 0], [0, 2]]).to_sparse(), None, "dense tensor with data"),
])
def test_bad_batches_raise_and_leave_the_monitor_unchanged(ids, mask, match):
    monitor = DataMonitor(128, window=10)
    monitor.observe_batch(torch.tensor([[3, 4, 5]]))
    before = monitor.values()
    with pytest.raises(ValueError, match=match):
        monitor.observe_batch(ids, mask)
    assert monitor.values() == before


def test_out_of_vocab_padding_is_ignored():
    monitor = DataMonitor(10, window=10)
    monitor.observe_batch(torch.tensor([[1, 2, -100]]), torch.tensor([[1, 1, 0]]))
    assert monitor.values()["trainguard_data_tokens_total"] == 2.0


def test_observe_text_controls_duplicates_and_mode():
    monitor = DataMonitor(10, window=3)
    # \x00 (Cc), \u200b (Cf, zero-width space), \x7f (Cc) count; \n \t \r do not.
    monitor.observe_text(["ab\x00c\n\x7f", "x\u200by\tz\r", "plain"])
    v = monitor.values()
    assert v[SPECIAL] == pytest.approx(3 / 17)
    assert v["trainguard_data_sequences_total"] == 3.0 and v["trainguard_data_tokens_total"] == 0.0
    assert KL not in v
    monitor.observe_text("plain")
    assert monitor.values()[DUP] == pytest.approx(1 / 3)
    assert monitor.values()[SPECIAL] == pytest.approx(1 / 16)  # 6 + 5 + 5 characters
    with pytest.raises(ValueError, match="observes text"):
        monitor.observe_batch(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="empty batch"):
        monitor.observe_text([])


def test_registry_export_parsed_from_exposition():
    registry = CollectorRegistry()
    monitor = DataMonitor(100, special_ids=(0,), window=10, registry=registry,
                          labels={"job": "llm", "run": "r1", "rank": "3"})
    monitor.observe_batch(torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]))
    samples = {s.name: s for fam in text_string_to_metric_families(generate_latest(registry).decode())
               for s in fam.samples}
    labels = {"job": "llm", "run": "r1", "rank": "3"}
    assert samples["trainguard_data_duplicate_ratio"].value == 0.5
    assert samples["trainguard_data_duplicate_ratio"].labels == labels
    assert samples["trainguard_data_special_token_ratio"].value == 0.25
    assert samples["trainguard_data_tokens_total"].value == 8.0
    assert samples["trainguard_data_sequences_total"].value == 2.0
    assert "trainguard_data_token_kl_divergence" not in samples  # no reference yet: absent
    with pytest.raises(ValueError):  # a second monitor on the same registry is refused
        DataMonitor(100, registry=registry)
    with pytest.raises(ValueError, match="label"):
        DataMonitor(100, labels={"host": "x"})


def test_all_padding_rows_are_no_sequences():
    # A quarantined sample of TokenBatches (or a batch padded to its size) is a row of padding:
    # counted as an empty sequence, every such row duplicated the others and shortened the lengths.
    rng = np.random.default_rng(6)
    rows = [list(rng.integers(1, 100, int(n))) for n in rng.integers(3, 12, 60)]
    monitor = DataMonitor(100, window=200, near_duplicates=True, length_reference=20, min_length_samples=20)
    real: list[tuple[int, ...]] = []
    for start in range(0, 60, 6):
        batch = rows[start:start + 6]
        ids, mask = padded(batch + [[], []], 12, left=start % 12 == 0)  # two rows of padding
        monitor.observe_batch(ids, mask)
        real.extend(tuple(int(t) for t in s) for s in batch)
    v = monitor.values()
    assert v["trainguard_data_sequences_total"] == 60.0
    assert v["trainguard_data_tokens_total"] == float(sum(len(s) for s in real))
    assert v[DUP] == pytest.approx(naive_duplicate_ratio(real, 200), abs=1e-12) and v[DUP] == 0.0
    assert v[NEAR] == 0.0
    lengths = [len(s) for s in real]
    assert v[PVALUE] == pytest.approx(stats.ks_2samp(lengths[:20], lengths[20:]).pvalue, abs=1e-9)


@pytest.mark.parametrize("kwargs", [{"vocab_size": 10.5}, {"vocab_size": "100"}, {"vocab_size": True},
                                    {"vocab_size": 100, "window": 2.0}])
def test_non_integer_sizes_are_value_errors(kwargs) -> None:
    with pytest.raises(ValueError, match="must be an integer"):
        DataMonitor(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"vocab_size": 1 << 40}, "vocab_size must be <= 4194304"),  # 24 TiB of tables: a MemoryError or the OOM killer
    ({"vocab_size": 100, "window": 10**9}, "window must be <= 16777216"),
    ({"vocab_size": 100, "shingle": 10**9}, "shingle must be <= 4096"),
    ({"vocab_size": 100, "length_reference": 10**12}, "length_reference must be <= 16777216"),
    ({"vocab_size": 100, "special_ids": "12"}, "collection of token ids"),  # not ids 1 and 2
    ({"vocab_size": 100, "special_ids": None}, "collection of token ids"),  # a TypeError
    ({"vocab_size": 100, "special_ids": [1.7]}, "integers"),  # read as id 1
    ({"vocab_size": 100, "pad_id": 1.5}, "pad_id"),  # no padding at all
    ({"vocab_size": 100, "kl_epsilon": "1e-6"}, "kl_epsilon"),  # a TypeError
])
def test_settings_of_the_wrong_kind_or_size_are_value_errors(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        DataMonitor(**kwargs)


def test_the_largest_settings_and_arrays_of_special_ids_are_taken() -> None:
    m = DataMonitor(1 << 22, special_ids=torch.tensor([0, 5]), pad_id=-100)
    assert m.config.special_ids == (0, 5)
    m.observe_batch(torch.tensor([[0, 1, -100]]))
    assert m.values()["trainguard_data_special_token_ratio"] == 0.5
    assert DataMonitor(10, special_ids=np.array([3])).config.special_ids == (3,)


def test_numpy_integers_are_integers() -> None:
    m = DataMonitor(np.int64(16), window=np.int32(8))
    m.observe_batch(torch.tensor([[1, 2, 3]]))
    assert m.values()["trainguard_data_sequences_total"] == 1
