"""The demo's model and data: a small GPT-like model trained on real text every machine has.

The text is the Python standard library's own source code, tokenised at byte level (vocabulary
256), so the demo needs no download. The fault injectors live here too, because they act on the
data and the schedule, not on trainguard.
"""

from __future__ import annotations

import math
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "VOCAB_SIZE",
    "PAD_ID",
    "CONTROL_BYTE_IDS",
    "TinyGPT",
    "ByteCorpus",
    "FaultPlan",
    "next_byte_loss",
    "phrase_bytes",
    "stdlib_source_bytes",
]

VOCAB_SIZE = 256
#: Padding uses byte 0 (NUL), which never occurs in Python source; masked out by attention_mask.
PAD_ID = 0
#: Control bytes that never occur in healthy Python source: the data monitor's "special" ids.
#: Tab (9), newline (10), carriage return (13) and form feed (12, used as a page break in a few
#: standard-library files) are ordinary text.
CONTROL_BYTE_IDS: tuple[int, ...] = tuple(
    b for b in range(32) if b not in (9, 10, 12, 13)
) + (127,)


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-like decoder: token + position embeddings, ``n_layers`` blocks, a tied head."""

    def __init__(self, *, vocab_size: int = VOCAB_SIZE, seq_len: int = 128, d_model: int = 128,
                 n_layers: int = 2, n_heads: int = 4) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.T


def next_byte_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy over the non-padding positions of ``ids`` (B, T+1); ``model`` is a
    :class:`TinyGPT` or its ``DistributedDataParallel`` wrapper (so gradients are all-reduced)."""
    logits = model(ids[:, :-1])
    target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


def stdlib_source_bytes(limit: int = 4 << 20) -> bytes:
    """Up to ``limit`` bytes of the standard library's top-level ``.py`` files, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes().replace(b"\x00", b"")
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise RuntimeError(f"no Python source files found under {root}")
    return b"".join(chunks)[:limit]


def phrase_bytes(limit: int = 1 << 16) -> bytes:
    """``limit`` bytes of sentences of a few repeated phrases (the same on every call): a corpus
    whose loss falls far below :func:`stdlib_source_bytes`'s, the easy source of a mixture."""
    rnd = random.Random(0)
    words = ["the cat", "a dog", "sat on", "the mat", "ran to", "the park", "and", "then", "slept"]
    text = ""
    while len(text) < limit:
        text += " ".join(rnd.choice(words) for _ in range(8)) + ".\n"
    return text.encode()[:limit]


@dataclass(kw_only=True, slots=True)
class FaultPlan:
    """Faults the demo injects, at known steps (all ranks agree on them)."""

    burst: tuple[int, int] = (40, 55)
    """Steps [start, end) whose batches carry duplicated and corrupted sequences."""
    lr_blowup: tuple[int, int | None] = (75, None)
    """Steps [start, end) where the LR schedule misbehaves (multiplied by ``lr_blowup_factor``);
    ``end`` None: from ``start`` on, for good (a schedule that does not fit the optimizer)."""
    lr_blowup_factor: float = 100.0
    """How far the misbehaving schedule overshoots."""
    nan_step: int = 115
    """Step whose loss turns NaN (on the last rank only: the controller sees it across ranks)."""

    def __post_init__(self) -> None:
        for name in ("burst", "lr_blowup"):
            start, end = getattr(self, name)
            if end is None and name == "lr_blowup":
                end = start
            if not (type(start) is int and type(end) is int and 0 <= start <= end):
                raise ValueError(f"{name} must be (start, end) with 0 <= start <= end, got {(start, end)}")
        if self.lr_blowup_factor <= 0 or not math.isfinite(self.lr_blowup_factor):
            raise ValueError("lr_blowup_factor must be a positive finite number")

    def lr_multiplier(self, step: int) -> float:
        start, end = self.lr_blowup
        return self.lr_blowup_factor if start <= step and (end is None or step < end) else 1.0

    def in_burst(self, step: int) -> bool:
        return self.burst[0] <= step < self.burst[1]


class ByteCorpus:
    """Random windows of ``seq_len + 1`` bytes from the corpus; deterministic per (rank, step)."""

    def __init__(self, data: bytes, *, seq_len: int, batch_size: int, seed: int = 0) -> None:
        if len(data) <= seq_len + 1:
            raise ValueError(f"corpus of {len(data)} bytes is too short for seq_len={seq_len}")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed

    def batch(self, step: int, rank: int, faults: FaultPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, attention_mask)``, both (batch, seq_len + 1) int64."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        ids = self.data[idx]
        mask = torch.ones_like(ids)
        if faults is not None and faults.in_burst(step):
            ids, mask = self._corrupt(ids, mask, g)
        return ids, mask

    def _corrupt(self, ids: torch.Tensor, mask: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Half the batch becomes copies of one sequence (a duplicated shard); a quarter becomes
        short runs of random bytes, control characters included (a corrupted, truncated shard)."""
        b, t = ids.shape
        n_dup, n_bad = b // 2, max(1, b // 4)
        ids, mask = ids.clone(), mask.clone()
        ids[:n_dup] = self.data[: t].clone()  # the same window in every burst batch, on every rank
        bad = slice(n_dup, n_dup + n_bad)
        ids[bad] = torch.randint(1, 256, (n_bad, t), generator=g)
        short = t // 4
        ids[bad, short:] = PAD_ID
        mask[bad, short:] = 0
        return ids, mask
