"""Model-FLOPs utilisation (MFU): the share of the device's peak arithmetic that the training step
turns into the model's own FLOPs (Chowdhery et al. 2022, PaLM, appendix B; what torchtitan,
Megatron and Composer report).

    mfu = tokens_per_second x flops_per_token / peak_flops

per rank: the rank's tokens per second of training, the FLOPs one token costs in a forward and
backward pass, and the peak of one device in the training dtype. Rematerialisation (activation
checkpointing) is not counted: it is hardware FLOPs, not model FLOPs.

``flops_per_token`` is declared by the run (``AgentConfig.flops_per_token``) or derived for a
standard decoder-only transformer from a Hugging Face config (:func:`transformer_flops_per_token`):

    6 N + 12 L H Q T

``N`` the parameters outside the embeddings (each takes 2 FLOPs per token in the forward pass and 4
in the backward), ``L`` layers, ``H`` attention heads of dimension ``Q``, ``T`` the sequence length
(the attention scores and their weighted sum: ``2 x 2 L H Q T`` forward, twice that backward).

``peak_flops`` is declared (``AgentConfig.peak_flops``) or looked up in :data:`PEAK_FLOPS` by the
CUDA device's name: dense (no structured sparsity) tensor-core peaks from the vendors' data sheets,
for bfloat16/float16 and for float32 (TF32 where the device has it). No peak is known for a CPU:
MFU is then absent unless declared.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["PEAK_FLOPS", "peak_flops", "transformer_flops_per_token", "mfu", "mfu_per_token_rate"]

#: Dense peak FLOP/s per device: (name fragment, 16-bit peak, float32/TF32 peak). The first
#: fragment found in ``torch.cuda.get_device_name()`` wins, so more specific names come first.
PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    ("GB200", 2.5e15, 1.25e15),
    ("B200", 2.25e15, 1.1e15),
    ("H200", 989e12, 494e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100", 989e12, 494e12),  # SXM
    ("H800", 989e12, 494e12),
    ("A100", 312e12, 156e12),
    ("A800", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("L40", 181e12, 90.5e12),
    ("L4", 121e12, 60e12),
    ("V100", 125e12, 15.7e12),  # no TF32: plain float32
    ("MI300X", 1307e12, 163e12),
    ("MI250X", 383e12, 95.7e12),
)

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """The dense peak of ``device_name`` for ``dtype`` (16-bit, else float32), None if unknown."""
    for fragment, half, single in PEAK_FLOPS:
        if fragment.lower() in device_name.lower():
            return half if dtype in _SIXTEEN_BIT else single
    return None


def _config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if type(value) is int and value > 0:
            return value
    return None


def transformer_flops_per_token(model: nn.Module, seq_len: int, *, params: int | None = None) -> float:
    """``6 N + 12 L H Q T`` for a decoder-only transformer with a Hugging Face style ``config``
    (``num_hidden_layers``/``n_layer``, ``num_attention_heads``/``n_head``,
    ``hidden_size``/``n_embd``, an optional ``head_dim``). ``N``: the parameters outside
    ``nn.Embedding`` modules (``params`` overrides: a sharded or tied model's true count).
    ``ValueError`` when the config does not give those shapes: declare ``flops_per_token``."""
    if type(seq_len) is not int or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    config = getattr(model, "config", None)
    layers = _config_int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _config_int(config, "num_attention_heads", "n_head")
    hidden = _config_int(config, "hidden_size", "n_embd", "d_model")
    if layers is None or heads is None or hidden is None:
        raise ValueError(f"{type(model).__name__} has no transformer config (layers, heads, hidden size): "
                         "declare AgentConfig.flops_per_token")
    head_dim = _config_int(config, "head_dim") or hidden // heads
    if params is None:
        embedding = {id(p) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                     for p in m.parameters(recurse=False)}
        params = sum(p.numel() for p in model.parameters() if id(p) not in embedding)
    return 6.0 * params + 12.0 * layers * heads * head_dim * seq_len


def mfu(tokens_per_second: float, flops_per_token: float, peak: float) -> float:
    """The model-FLOPs utilisation of one device (NaN for a non-finite or missing input)."""
    if not (math.isfinite(tokens_per_second) and flops_per_token > 0 and peak > 0):
        return math.nan
    return tokens_per_second * flops_per_token / peak


def mfu_per_token_rate(model: nn.Module, device: torch.device, flops_per_token: float | None,
                       peak: float | None) -> float | None:
    """``flops_per_token / peak`` for the agent (MFU = tokens/s x this), from the declared values
    or the derived ones; None when either cannot be had (no MFU is exported then)."""
    if flops_per_token is None:
        config = getattr(model, "config", None)
        seq_len = _config_int(config, "max_position_embeddings", "n_positions", "max_seq_len")
        if seq_len is None:
            return None
        try:
            flops_per_token = transformer_flops_per_token(model, seq_len)
        except ValueError:
            return None
    if peak is None:
        if device.type != "cuda":
            return None
        peak = peak_flops(torch.cuda.get_device_name(device), torch.bfloat16)
        if peak is None:
            return None
    return flops_per_token / peak
