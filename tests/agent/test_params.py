"""How the agent groups parameters into layers (``trainer_agent/measure/params.py``): by repeated block by
default, on the real Hugging Face GPT-2 and Llama classes (tiny configurations, nothing
downloaded), ``layer_depth`` as the override, and the consumers of the names: the per-layer
metrics and a 2-rank DDP desync finding that names the perturbed block."""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks
from trainer_agent.measure.params import ParamIndex, layer_names, sparse_gradient_params

transformers = pytest.importorskip("transformers")


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=4, n_head=2))


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16))


def grouped(model: nn.Module, layer_depth: int | None = None) -> dict[str, list[str]]:
    """Layer name -> the parameter names in it."""
    names = layer_names(model, layer_depth)
    out: dict[str, list[str]] = {}
    for n, p in model.named_parameters():
        out.setdefault(names[id(p)], []).append(n)
    return out


def test_gpt2_blocks_are_layers() -> None:
    model = tiny_gpt2()
    layers = grouped(model)
    blocks = [f"transformer.h.{i}" for i in range(4)]
    # lm_head's weight is tied to wte: named_parameters lists it once, as transformer.wte.weight
    assert sorted(layers) == sorted(["transformer.wte", "transformer.wpe", "transformer.ln_f", *blocks])
    for i, block in enumerate(blocks):
        assert layers[block] == [n for n, _ in model.transformer.h[i].named_parameters(prefix=block)]
    # the old fixed depth still works as the override: every block is one layer
    assert sorted(grouped(model, layer_depth=2)) == ["transformer.h", "transformer.ln_f", "transformer.wpe",
                                                     "transformer.wte"]


def test_llama_blocks_are_layers() -> None:
    model = tiny_llama()
    layers = grouped(model)
    assert sorted(layers) == ["lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1",
                              "model.layers.2", "model.norm"]
    assert len(layers["model.layers.1"]) == len(list(model.model.layers[1].parameters()))
    assert sorted(grouped(model, layer_depth=2)) == ["lm_head", "model.embed_tokens", "model.layers", "model.norm"]
    assert sorted(grouped(model, layer_depth=4)) == sorted(
        ["lm_head", "model.embed_tokens", "model.norm"]
        + [f"model.layers.{i}.{part}" for i in range(3) for part in ("self_attn", "mlp")]
        + [f"model.layers.{i}.{norm}" for i in range(3) for norm in ("input_layernorm", "post_attention_layernorm")])


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


class MoeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.experts = nn.ModuleList([Expert(), Expert()])


class Wrapper(nn.Module):  # stands for DDP / torch.compile: the model under a "module." prefix
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_outermost_block_wins_and_unlike_siblings_are_not_blocks() -> None:
    model = nn.Sequential(nn.Embedding(8, 4), MoeBlock(), MoeBlock(), nn.LayerNorm(4))
    # the two MoeBlocks are blocks (their experts stay in them); the embedding and the norm have no
    # sibling of their class: their own module path
    assert sorted(grouped(model)) == ["0", "1", "2", "3"]
    assert grouped(model)["1"] == ["1.router.weight", "1.router.bias", "1.experts.0.fc.weight",
                                   "1.experts.0.fc.bias", "1.experts.1.fc.weight", "1.experts.1.fc.bias"]
    lone = nn.ModuleDict({"block": MoeBlock()})  # experts of a lone block: repeated blocks inside it
    assert sorted(grouped(lone)) == ["block.experts.0", "block.experts.1", "block.router"]
    assert grouped(Wrapper(tiny_llama())).keys() == grouped(tiny_llama()).keys()
    assert grouped(Wrapper(tiny_llama()), layer_depth=1).keys() == {"model", "lm_head"}  # "module." is no layer


LLAMA_LAYERS = ["lm_head", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm"]
LLAMA_DEPTH_4 = sorted(["lm_head", "model.embed_tokens", "model.norm"]
                       + [f"model.layers.{i}.{part}" for i in range(3)
                          for part in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")])


def _wrapped_llama() -> nn.Module:
    """The torchtitan patterns on Llama's blocks: activation checkpointing of every other block
    (``checkpoint_wrapper``), ``torch.compile`` of another, one left as it is."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_llama()
    layers = model.model.layers
    layers[0] = checkpoint_wrapper(layers[0])
    layers.register_module("1", torch.compile(layers[1]))
    layers[2] = checkpoint_wrapper(layers[2])
    return model


def test_wrapped_blocks_are_named_as_the_blocks_they_wrap() -> None:
    """A block under ``checkpoint_wrapper`` or ``torch.compile`` is a block like its unwrapped
    siblings, and the wrapper's attribute (``_checkpoint_wrapped_module``, ``_orig_mod``) is no
    part of a layer name or of ``layer_depth``'s count (they made ``model.layers.1._orig_mod`` one
    layer at depth 4, and the lone unwrapped block's modules layers of their own)."""
    model = _wrapped_llama()
    layers = grouped(model)
    assert sorted(layers) == LLAMA_LAYERS
    assert len(layers["model.layers.1"]) == len(list(model.model.layers[1].parameters()))
    assert sorted(grouped(model, layer_depth=4)) == LLAMA_DEPTH_4
    assert sorted(grouped(Wrapper(model), layer_depth=4)) == LLAMA_DEPTH_4


def _fsdp_names_worker(rank: int, init: str, out: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=1)
    model = tiny_llama()
    layers = model.model.layers
    layers[0] = checkpoint_wrapper(layers[0])
    for layer in layers:  # fully_shard swaps their classes: FSDPCheckpointWrapper, FSDPLlamaDecoderLayer
        fully_shard(layer)
    fully_shard(model)
    names = (sorted(grouped(model)), sorted(grouped(model, layer_depth=4)))
    dist.destroy_process_group()
    torch.save(names, f"{out}/rank{rank}.pt")


@pytest.mark.distributed
def test_fsdp2_sharded_wrapped_blocks_are_named_as_the_blocks_they_wrap(tmp_path) -> None:
    [(layers, depth_4)] = spawn_ranks(_fsdp_names_worker, 1, tmp_path, timeout=120)
    assert layers == LLAMA_LAYERS
    assert depth_4 == LLAMA_DEPTH_4


def test_sparse_gradient_parameters_are_named_and_kept_apart() -> None:
    """The weights of sparse ``nn.Embedding``/``nn.EmbeddingBag`` modules, named without
    ``torch.compile``'s wrapper; a dense embedding is an ordinary parameter. ``ParamIndex`` keeps
    the sparse ones apart (``sparse``) and refuses an optimizer with nothing else."""
    model = nn.ModuleDict({"tok": nn.Embedding(10, 4, sparse=True), "bag": nn.EmbeddingBag(10, 4, sparse=True),
                           "pos": nn.Embedding(10, 4), "head": nn.Linear(4, 2)})
    names = sparse_gradient_params(torch.compile(model))
    assert sorted(names.values()) == ["bag.weight", "tok.weight"]
    assert set(names) == {id(model["tok"].weight), id(model["bag"].weight)}
    index = ParamIndex(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert {id(p) for p in index.sparse} == set(names)
    assert {id(p) for p in index.params} == {id(p) for p in model.parameters()} - set(names)
    with pytest.raises(ValueError, match="2 with sparse gradients"):
        ParamIndex(model, torch.optim.SGD([model["tok"].weight, model["bag"].weight], lr=0.1))


@pytest.mark.parametrize("change", ["unfreeze", "add_param_group"])
def test_parameters_trainable_after_attach_are_left_out_and_named_once(change: str, caplog) -> None:
    """A parameter unfrozen after attach, or a param group added (Lightning's BackboneFinetuning
    does both): measured as before, over the parameters attached, without an agent error (an added
    group made every report step's update-size ratio fail), and a warning once, with the count."""
    import trainer_agent as ta

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    backbone, head = list(model[0].parameters()), list(model[2].parameters())
    for p in backbone:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters() if change == "unfreeze" else head, lr=1e-2, weight_decay=0.1)
    agent = ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=None, report_every=1))
    assert agent.parts.params.unmeasured(opt) == 0
    norms = []
    for step in range(4):
        if step == 2:
            for p in backbone:
                p.requires_grad_(True)
            if change == "add_param_group":
                opt.add_param_group({"params": backbone, "lr": 1e-3})
        model(torch.randn(16, 8)).square().mean().backward()
        norms.append(math.sqrt(sum(float(p.grad.double().square().sum()) for p in head)))
        opt.step()
        opt.zero_grad()
        agent.end_step(0.0)
        latest = agent.latest()
        assert latest["trainguard_grad_norm"] == pytest.approx(norms[-1], rel=1e-6)
        assert math.isfinite(latest["trainguard_update_size_ratio"]) and latest["trainguard_agent_errors_total"] == 0
    agent.close()
    told = [r.getMessage() for r in caplog.records if "did not hold at attach" in r.getMessage()]
    assert len(told) == 1 and "holds 2 trainable parameter(s)" in told[0]


def test_param_index_orders_layers_as_the_optimizer_holds_them() -> None:
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    index = ParamIndex(model, opt)
    names = layer_names(model)
    assert [index.layers[i] for i in index.layer_ids.tolist()] == [names[id(p)] for p in index.params]


def test_per_layer_metrics_name_the_blocks() -> None:
    import trainer_agent as ta

    model = tiny_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r",
                      config=ta.AgentConfig(metrics_port=None, report_every=1, per_layer="all"))
    try:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.double().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        got = agent.latest()
    finally:
        agent.close()
    for i in range(4):
        block = f"transformer.h.{i}"
        want = math.sqrt(sum(float(g.square().sum()) for n, g in grads.items() if n.startswith(block + ".")))
        assert got[f'trainguard_layer_grad_norm{{layer="{block}"}}'] == pytest.approx(want, rel=1e-6)
    assert not any('layer="transformer.h"' in k for k in got)


WORLD = 2
PERTURBED = "model.layers.1"


def _ddp_worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    import trainer_agent as ta

    model = tiny_llama()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    agent = ta.attach(ddp, opt, job="fp", run="fp-1", config=ta.AgentConfig(metrics_port=None, report_every=1))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = ddp(input_ids=ids, labels=ids).loss
    loss.backward()
    if rank == 1:  # one element of one block's all-reduced gradient, by 1e-4 of that block's norm
        block = model.model.layers[1]
        norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in block.parameters()))
        block.mlp.down_proj.weight.grad[0, 0] += 1e-4 * norm
    opt.step()
    opt.zero_grad()
    agent.end_step(loss)
    agent.latest()
    found = [(d.kind, d.layer, d.ranks) for d in agent.desync]
    agent.close()
    del agent, ddp
    gc.collect()
    dist.destroy_process_group()
    torch.save(found, f"{out}/rank{rank}.pt")


@pytest.mark.distributed
def test_ddp_desync_names_the_block(tmp_path) -> None:
    out = spawn_ranks(_ddp_worker, WORLD, tmp_path, timeout=180)
    assert out[1] == []  # the leader compares; the other rank holds no findings
    # with two ranks either one may be the odd one out; the block is named, not "model.layers"
    assert [(kind, layer) for kind, layer, _ in out[0] if kind == "grad"] == [("grad", PERTURBED)]


def test_gradients_come_settled_and_the_counts_follow_the_parameters() -> None:
    """``grads()`` tags a bucket whose gradients are all present with its parameters' settled
    layout (their shapes, known at attach), and not one with a gradient missing (its stand-in zero
    has another shape); ``trainable_elements`` follows freezing; ``versions`` moves with an
    in-place write, as the counters read one by one do."""
    from trainer_agent.measure import staged

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 1).double())
    index = ParamIndex(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(5, 4)
    model[2](model[1](model[0](x)).double()).sum().backward()
    grads = index.grads()
    assert [type(b) for b in grads] == [staged.Settled, staged.Settled]
    assert [b.layout for b in grads] == [b.layout for b in index.buckets]
    assert [[g.shape for g in b] for b in grads] == [list(b.layout.shapes) for b in index.buckets]
    model[1].bias.grad = None
    grads = index.grads()
    assert type(grads[0]) is list and type(grads[1]) is staged.Settled
    assert grads[0][3].shape == () and float(grads[0][3]) == 0.0
    assert index.trainable_elements() == 15 + 8 + 3
    model[1].requires_grad_(False)
    assert index.trainable_elements() == 15 + 3
    before = index.versions()
    assert before == tuple(p._version for p in index.locals)
    with torch.no_grad():
        model[2].weight.mul_(2)
    after = index.versions()
    assert after != before and after == tuple(p._version for p in index.locals)


def test_ungraded_are_the_parameters_without_a_gradient_read_or_from_grads() -> None:
    """``ungraded`` names the parameters without a ``.grad``, read from the parameters or from
    what ``grads()`` made of them (a settled bucket misses none); None when none is missing."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 1).double())
    index = ParamIndex(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model[2](model[1](model[0](torch.randn(5, 4))).double()).sum().backward()
    assert index.ungraded() is None and index.ungraded(index.grads()) is None
    model[0].weight.grad = model[2].bias.grad = None
    expected = [i for i, p in enumerate(index.params) if p is model[0].weight or p is model[2].bias]
    assert index.ungraded().tolist() == expected and index.ungraded(index.grads()).tolist() == expected
    model[2].bias.grad = torch.zeros(1, dtype=torch.float64)  # the float64 bucket settled again
    assert index.ungraded(index.grads()).tolist() == expected[:1]
