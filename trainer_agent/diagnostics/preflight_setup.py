"""The pre-flight's checks of how the run is set up (``trainer_agent/diagnostics/preflight.py`` runs them):
the batch's token ids (``data``), the optimizer and loss-scaler settings (``adam_eps``, ``grad_clip``,
``weight_decay``, ``grad_scaler``), the ranks' starting parameters (``ranks_agree``) and the
endpoints (``metrics_endpoint``, ``controller``)."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from trainer_agent.compat import torch_private
from trainer_agent.compat.torch_collectives import all_gather_single
from trainer_agent.config import AgentConfig
from trainer_agent.diagnostics.preflight_report import Check
from trainer_agent.measure import triage_stats as triage
from trainer_agent.measure.fingerprint import desync, findings, for_ranks
from trainer_agent.measure.train_parts import TrainParts

__all__ = ["BIG_MODEL_PARAMS", "data_check", "config_checks", "ranks_check", "endpoint_checks"]

#: Above this many parameters Adam's eps should be 1e-8 (the stability guide, 2.2).
BIG_MODEL_PARAMS = 10e9


def _token_ids(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, Mapping):
        batch = batch.get("input_ids")
    if isinstance(batch, torch.Tensor) and not batch.is_floating_point() and not batch.is_complex():
        return batch
    return None


def data_check(config: AgentConfig, batch: Any) -> Check:
    ids = _token_ids(batch)
    vocab = config.vocab_size
    if ids is None or vocab is None:
        return Check("data", "skip", "no token ids in the batch, or no AgentConfig.vocab_size")
    ids = ids.detach().cpu()
    rows = ids.reshape(-1, ids.shape[-1]) if ids.dim() else ids.reshape(1, 1)
    outside = int(((rows < 0) | (rows >= vocab)).sum())
    special = sum(int((rows == s).sum()) for s in config.special_ids)
    share = special / max(rows.numel(), 1)
    seqs = [tuple(r.tolist()) for r in rows]
    repeated = (len(seqs) - len(set(seqs))) / max(len(seqs), 1)
    values = {"ids_outside_vocab": outside, "special_token_ratio": share, "repeated_sequence_ratio": repeated}
    problems = []
    if outside:
        problems.append(f"{outside} token id(s) outside the vocabulary of {vocab}")
    if share > 1e-4:
        problems.append(f"special tokens are {share:.2%} of the batch (above 0.01%)")
    if repeated > 0.05:
        problems.append(f"{repeated:.0%} of the sequences repeat (above 5%)")
    if outside:
        return Check("data", "fail", "; ".join(problems), values)
    return Check("data", "warn" if problems else "pass", "; ".join(problems) or "token ids, special tokens and repeats look sane", values)


def _gradient_scale_eps(opt: torch.optim.Optimizer) -> tuple[list[float], str]:
    """The optimizer's eps on the scale of |g| (what it adds to sqrt(v)), per group, and how it was
    read; an empty list for a rule without one."""
    rule = triage.update_rule(opt)
    if rule in ("adaptive", "trust_ratio"):
        return [float(g["eps"]) for g in opt.param_groups if isinstance(g.get("eps"), (int, float))], "eps"
    if rule != "adafactor":
        return [], ""
    out = []
    for g in opt.param_groups:
        eps = g.get("eps")
        eps1 = eps[0] if isinstance(eps, (tuple, list)) and eps else None
        if isinstance(opt, torch.optim.Adafactor):  # torch clamps v at eps1^2: eps1 on the |g| scale
            dtype = g["params"][0].dtype if g["params"] else torch.float32
            out.append(float(eps1) if eps1 is not None else float(torch.finfo(dtype).eps))
        elif eps1 is not None:  # Hugging Face adds eps1 to g^2
            out.append(math.sqrt(float(eps1)))
    how = ("eps1 (torch's Adafactor: None means the parameters' dtype epsilon)" if isinstance(opt, torch.optim.Adafactor)
           else "sqrt(eps[0]) (Adafactor adds it to g^2)")
    return out, how


def _eps_check(opt: torch.optim.Optimizer, n: int) -> Check:
    eps, how = _gradient_scale_eps(opt)
    if not eps:
        return Check("adam_eps", "skip", f"{type(opt).__name__} has no eps in the denominator of its update")
    big = max(eps)
    values = {"eps": big, "params": n, "read_as": how, "rule": triage.update_rule(opt)}
    if n > BIG_MODEL_PARAMS and big > 1e-8:
        return Check("adam_eps", "warn",
                     f"{how} = {big:g} on a model of {n / 1e9:.3g}B parameters: above 10B use 1e-8 "
                     f"(a larger eps flattens the update of parameters with small gradients)", values)
    return Check("adam_eps", "pass", f"{how} = {big:g} for {n / 1e9:.3g}B parameters", values)


def config_checks(parts: TrainParts, declared_params: int | None, clip_grad_norm: float | None | str) -> list[Check]:
    opt, scaler = parts.optimizer, parts.scaler
    n = declared_params if declared_params is not None else sum(p.numel() for p in parts.params.params)
    checks = []
    checks.append(_eps_check(opt, n))
    if clip_grad_norm == "unknown":
        checks.append(Check("grad_clip", "skip", "pass clip_grad_norm= (the max norm your loop clips to, or None)"))
    elif clip_grad_norm is None:
        checks.append(Check("grad_clip", "warn", "no gradient clipping: clipping the global norm at 1.0 is the usual guard against spikes"))
    elif not 0.1 <= float(clip_grad_norm) <= 10.0:
        checks.append(Check("grad_clip", "warn", f"gradients clipped at {clip_grad_norm:g}: about 1.0 is usual",
                            {"max_norm": float(clip_grad_norm)}))
    else:
        checks.append(Check("grad_clip", "pass", f"gradients clipped at {clip_grad_norm:g}", {"max_norm": float(clip_grad_norm)}))
    names = {id(p): n for n, p in parts.model.named_parameters()}
    decayed = [names.get(id(p), "?") for g in opt.param_groups if float(g.get("weight_decay", 0.0) or 0.0) > 0
               for p in g["params"] if p.requires_grad and p.dim() <= 1]
    checks.append(Check("weight_decay", "warn" if decayed else "pass",
                        (f"weight decay applies to {len(decayed)} bias / normalisation tensor(s) ({', '.join(decayed[:5])}): "
                         f"put them in a param group with weight_decay=0" if decayed else
                         "no weight decay on biases or normalisation weights"),
                        {"decayed": decayed[:64]} if decayed else {}))
    if scaler is None or not scaler.is_enabled():
        checks.append(Check("grad_scaler", "skip", "no enabled GradScaler (one the loop uses is passed to attach as scaler=)"))
    else:
        init = torch_private.grad_scaler_init_scale(scaler)
        interval = int(scaler.get_growth_interval())
        problems = []
        if init != 2.0**10:
            problems.append(f"init_scale {init:g} (2**10 = 1024 recommended)")
        if interval != 2000:
            problems.append(f"growth_interval {interval} (2000 recommended)")
        checks.append(Check("grad_scaler", "warn" if problems else "pass",
                            "; ".join(problems) or "init_scale 2**10, growth_interval 2000",
                            {"init_scale": init, "growth_interval": interval}))
    return checks


def ranks_check(parts: TrainParts, desync_rel_tol: float) -> Check:
    world_size = parts.world_size
    if world_size < 2:
        return Check("ranks_agree", "skip", "one rank")
    params = parts.params
    fp = for_ranks(params, world_size)
    if fp is None:
        return Check("ranks_agree", "skip", "no parameter is replicated across ranks (every rank holds "
                     "different shards): nothing to compare")
    mine = fp.layer_values(params.buckets)
    row = torch.cat([torch.zeros_like(mine).reshape(-1), mine.reshape(-1)])
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    row = row.to(device)
    out = torch.empty(world_size * row.numel(), dtype=row.dtype, device=device)
    all_gather_single(out, row)
    compared = desync(out.view(world_size, -1), fp.layers, fp.k, fp.groups)
    vectors, found = findings(compared.tolist(), world_size, fp.names, desync_rel_tol)
    params_found = [d for d in found if d.kind == "param"]
    if params_found:
        return Check("ranks_agree", "fail",
                     "ranks start from different parameters: " + "; ".join(
                         f"layer {d.layer!r} on rank(s) {list(d.ranks)} (relative difference {d.rel_diff:.3g})"
                         for d in params_found[:5]),
                     {"layers": [asdict(d) for d in params_found[:32]]})
    if fp.groups is not None:
        return Check("ranks_agree", "pass", "every replica of each parameter shard holds the same values "
                     "(element-wise fingerprints)")
    return Check("ranks_agree", "pass", f"all {world_size} ranks hold the same parameters (element-wise fingerprints)")


def endpoint_checks(url: str | None, controller: str | None, control: Any, rank: int, timeout: float) -> list[Check]:
    """The rank's /metrics (``url``) and, with a ``controller`` configured, the control plane's link."""
    checks = []
    if url is None:
        checks.append(Check("metrics_endpoint", "skip", "no /metrics endpoint (metrics_port=None)"))
    else:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - our own endpoint
                body = resp.read(1 << 20)
            ok = resp.status == 200 and b"trainguard_" in body
            checks.append(Check("metrics_endpoint", "pass" if ok else "fail",
                                f"{url} answered {resp.status}" + ("" if ok else " without trainguard metrics")))
        except OSError as exc:
            checks.append(Check("metrics_endpoint", "fail", f"{url} did not answer: {exc}"))
    if controller is None:
        checks.append(Check("controller", "skip", "no controller configured"))
    elif control is None or control.client is None:
        checks.append(Check("controller", "skip" if rank else "fail",
                            "only rank 0 talks to the controller" if rank else "the control plane did not start"))
    else:
        up = control.values().get("trainguard_agent_controller_up") == 1.0
        checks.append(Check("controller", "pass" if up else "fail",
                            f"{controller} " + ("accepted the run" if up else "is not reachable")))
    return checks
