"""Model-FLOPs utilisation (``trainer_agent/measure/flops.py``): the transformer formula against a hand
count of a real GPT-2's parameters, the peak table's lookups, and MFU from its definition."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_agent.measure.flops import mfu, peak_flops, transformer_flops_per_token


def _gpt2(layers: int = 2, d: int = 16, heads: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_head=heads, n_embd=d, n_positions=32, vocab_size=50))


def test_transformer_flops_per_token_match_a_hand_count_of_gpt2() -> None:
    layers, d, heads, seq = 2, 16, 2, 24
    model = _gpt2(layers, d, heads)
    # Per block: ln_1 and ln_2 (2d each), c_attn (d x 3d + 3d), attn.c_proj (d x d + d),
    # mlp.c_fc (d x 4d + 4d), mlp.c_proj (4d x d + d); then ln_f (2d). The LM head is tied to
    # the token embedding; the embeddings are not counted.
    per_block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    n = layers * per_block + 2 * d
    expected = 6 * n + 12 * layers * heads * (d // heads) * seq
    assert transformer_flops_per_token(model, seq) == expected
    assert transformer_flops_per_token(model, seq, params=10**9) == 6e9 + 12 * layers * heads * (d // heads) * seq


def test_a_model_without_a_transformer_config_must_declare_its_flops() -> None:
    with pytest.raises(ValueError, match="declare AgentConfig.flops_per_token"):
        transformer_flops_per_token(torch.nn.Linear(3, 3), 8)
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        transformer_flops_per_token(_gpt2(), 0)


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
    ("NVIDIA H200", torch.float16, 989e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
    ("NVIDIA A100-SXM4-80GB", torch.float32, 156e12),
    ("NVIDIA L40S", torch.bfloat16, 362e12),
    ("NVIDIA L4", torch.bfloat16, 121e12),
    ("NVIDIA GB200", torch.bfloat16, 2.5e15),
    ("Tesla V100-SXM2-32GB", torch.float32, 15.7e12),
    ("Intel Xeon", torch.bfloat16, None),
])
def test_peaks_are_looked_up_by_the_most_specific_device_name(name, dtype, peak) -> None:
    assert peak_flops(name, dtype) == peak


def test_mfu_is_model_flops_over_the_peak() -> None:
    # 4,000 tokens/s of a 7B model (6 x 7e9 FLOPs a token, attention aside) on a 312 TFLOP/s device.
    assert mfu(4000.0, 6 * 7e9, 312e12) == pytest.approx(4000 * 42e9 / 312e12)
    assert math.isnan(mfu(math.inf, 1.0, 1.0)) and math.isnan(mfu(math.nan, 1.0, 1.0))


def test_the_agent_exports_mfu_from_its_tokens_per_second_and_the_derived_flops() -> None:
    import trainer_agent as ta

    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peak = 1e9  # a declared peak: a CPU has none in the table
    agent = ta.attach(model, opt, job="mfu", run="mfu-1",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, peak_flops=peak))
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(torch.tensor(1.0), tokens=ids.numel())
    got = agent.latest()
    agent.close()
    per_token = transformer_flops_per_token(model, 32)  # n_positions: the maximum sequence length
    assert got["trainguard_mfu"] == pytest.approx(got["trainguard_tokens_per_second"] * per_token / peak, rel=1e-12)
    linear = torch.nn.Linear(2, 2)
    no_peak = ta.attach(linear, torch.optim.SGD(linear.parameters(), lr=0.1), job="mfu", run="mfu-2",
                        config=ta.AgentConfig(metrics_port=None))
    assert no_peak.reports.mfu_per_token_rate is None  # neither a transformer config nor a peak: no MFU
    no_peak.close()
    with pytest.raises(ValueError, match="peak_flops must be None or a finite number > 0"):
        ta.AgentConfig(peak_flops=0.0)
