"""Pre-flight: the checks of the stability guide's checklist (6.1) and its optimizer and
mixed-precision advice (2.2, 2.3), run once on a real batch before the first training step.

    agent = attach(model, optimizer, job=..., run=..., scaler=scaler)
    report = agent.preflight(batch, loss_fn=lambda model, batch: model(**batch).loss,
                             clip_grad_norm=1.0)         # what the loop will clip to, if anything
    for batch in loader: ...

One forward and backward pass on ``batch`` (under data parallelism every rank must call it: the
backward all-reduces as in training), then one simulated optimizer step on copies of the
parameters and of the optimizer's state. Nothing the training loop owns changes: the weights, their
``.grad``, the optimizer's state, the module buffers (e.g. BatchNorm statistics) and the random
number generators are as they were (bit for bit), and the agent's step count does not move.

Each check ends ``pass``, ``warn``, ``fail`` or ``skip`` (not applicable):

=====================  =======================================================================
``nonfinite``          the loss and every gradient element finite (fail otherwise)
``grad_values``        per layer, max |g| and ||g|| below 1e3 (fail above)
``no_grad``            parameters that get no gradient, or an all-zero one (warn)
``update_size``        one simulated step, per layer: ||dW|| against the optimizer's rule
                       (``trainer_agent/measure/triage_stats.py``; warn beyond 3x) and ||dW|| / ||W|| above 1e-2
``data``               the batch: token ids in the vocabulary, special tokens above 1e-4, repeated
                       sequences above 5% (needs ``AgentConfig.vocab_size``; skip otherwise)
``adam_eps``           Adam-like eps above 1e-8 on more than 10B parameters (warn); the count is
                       the model's, or ``declared_params`` (a sharded model, a rehearsal)
``grad_clip``          ``clip_grad_norm`` as the loop will use it: none, or far from 1.0 (warn)
``weight_decay``       weight decay on biases and normalisation weights (1-dim tensors; warn)
``grad_scaler``        GradScaler init scale 2**10 and growth interval 2000 (warn otherwise)
``ranks_agree``        every rank starts from the same parameters (element-wise fingerprints,
                       ``trainer_agent/measure/fingerprint.py``; fail naming ranks and layers)
``metrics_endpoint``   this rank's /metrics answers (fail otherwise; skip without one)
``controller``         the controller accepted the run's registration (fail otherwise; skip
                       without a controller)
``init_distribution``  ``loss_boundary``, ``amp_overflow``, ``input_pipeline``: how the weights
                       start, the loss on extreme inputs, a pass in the mixed-precision dtype, the
                       loader against the step (``trainer_agent/diagnostics/preflight_probes.py``)
``cuda_launch_blocking``  ``nccl_sockets``, ``socket_buffers``: the launch, NCCL and kernel
                       socket settings, read and never changed (``trainer_agent/diagnostics/environment.py``)
=====================  =======================================================================

The report goes to the log and, from rank 0, to the controller (``POST /v1/runs/{run}/preflight``,
shown in the run's status). With ``fatal`` (or ``AgentConfig.preflight_fatal``) a failed check
raises ``RuntimeError`` here, before training starts: the one place the agent raises on purpose.
"""

from __future__ import annotations

import logging
import math
import os
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from trainguard.protocol.wire import PreflightCheck, PreflightResult
from trainer_agent.diagnostics import environment, preflight_probes as probes
from trainer_agent.compat import torch_private
from trainer_agent.config import AgentConfig
from trainer_agent.measure.fingerprint import desync, findings, for_ranks
from trainer_agent.measure import triage_stats as triage
from trainer_agent.measure.train_parts import TrainParts

__all__ = ["Check", "PreflightReport", "PreflightOnly", "PREFLIGHT_ONLY_ENV", "forward_backward", "run_preflight", "raise_if_fatal", "to_wire", "GRAD_LIMIT", "BIG_MODEL_PARAMS"]

log = logging.getLogger(__name__)

Status = Literal["pass", "warn", "fail", "skip"]
#: Gradient values and norms should stay below this (the stability guide, 6.1).
GRAD_LIMIT = 1e3
#: Above this many parameters Adam's eps should be 1e-8 (the stability guide, 2.2).
BIG_MODEL_PARAMS = 10e9


#: Set (to 1) by ``trainguard preflight``: ``Agent.preflight`` ends the process's script right
#: after the checks by raising :class:`PreflightOnly`, before any training step.
PREFLIGHT_ONLY_ENV = "TRAINGUARD_PREFLIGHT_ONLY"


class PreflightOnly(BaseException):
    """Raised by ``Agent.preflight`` under ``trainguard preflight``: carries the report out of the
    user's script (a ``BaseException``, so the script's ``except Exception`` does not catch it;
    its ``finally`` blocks, e.g. ``agent.close()``, still run)."""

    def __init__(self, report: PreflightReport | None, rank: int) -> None:
        super().__init__("trainguard preflight: the checks ran; training is not started" if report is not None else
                         "trainguard preflight: the script started training without calling agent.preflight")
        self.report, self.rank = report, rank  # report None: an optimizer step came first


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PreflightReport:
    checks: tuple[Check, ...]
    seconds: float

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warned(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    def status(self, name: str) -> Status:
        return next(c.status for c in self.checks if c.name == name)

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "checks": [asdict(c) for c in self.checks]}

    def summary(self) -> str:
        lines = [f"{c.status.upper():4} {c.name}: {c.detail}" for c in self.checks]
        return "\n".join(lines)

    def table(self) -> str:
        """The checks as a table, with a count per status on the last line."""
        width = max((len(c.name) for c in self.checks), default=5)
        lines = [f"{'CHECK':<{width}}  STATUS  DETAIL"]
        lines += [f"{c.name:<{width}}  {c.status.upper():<6}  {c.detail}" for c in self.checks]
        counts = {s: sum(c.status == s for c in self.checks) for s in ("pass", "warn", "fail", "skip")}
        lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({self.seconds:.2f} s)")
        return "\n".join(lines)


def _loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", out)
    if isinstance(out, Mapping) and "loss" in out:
        loss = out["loss"]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("preflight needs a scalar loss: pass loss_fn(model, batch) returning one")
    return loss.reshape(())


def forward_backward(parts: TrainParts, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None, *,
                      replay_rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None,
                      scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """One forward/backward on ``batch``; returns (loss, each parameter's gradient). Restores the
    parameters' ``.grad``, the module buffers and the RNG states; resets the agent's step state (``parts``: ``TrainParts``).
    ``replay_rng``: (CPU, CUDA) RNG states to run the pass from (a recompute of a step's pass);
    ``scale``: applied to the loss before ``backward`` (the GradScaler's scale)."""
    model, params = parts.model, parts.params.params
    saved_grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda_on = torch.cuda.is_available() and torch.cuda.is_initialized()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if cuda_on else None
    try:
        if replay_rng is not None:
            torch.set_rng_state(replay_rng[0])
            if replay_rng[1] is not None and cuda_on:
                torch.cuda.set_rng_state_all(replay_rng[1])
        for p in params:
            p.grad = None
        out = loss_fn(model, batch) if loss_fn is not None else model(batch)
        loss = _loss_of(out)
        (scale(loss) if scale is not None else loss).backward()
        grads = [p.grad for p in params]
        return loss.detach(), grads
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, copy in buffers:
                b.copy_(copy)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if replay_rng is None:
            parts.reset_step()


def _simulate_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                   grads: list[torch.Tensor | None]) -> list[torch.Tensor] | None:
    """Weights after one step of a copy of ``optimizer`` (same class, groups and state) on copies
    of ``params`` with ``grads``; None when the optimizer cannot be rebuilt that way."""
    copies = {id(p): p.detach().clone().requires_grad_(True) for p in params}
    grad_of = {id(p): g for p, g in zip(params, grads)}
    groups = []
    for g in optimizer.param_groups:
        group = {k: v for k, v in g.items() if k != "params"}
        group["params"] = [copies.get(id(p), p.detach().clone()) for p in g["params"]]
        groups.append(group)
    try:
        shadow = type(optimizer)(groups)
        state = optimizer.state_dict()
        shadow.load_state_dict({"state": {k: {n: v.clone() if isinstance(v, torch.Tensor) else v
                                               for n, v in s.items()} for k, s in state["state"].items()},
                                "param_groups": state["param_groups"]})
    except Exception:  # noqa: BLE001 - an optimizer with a custom constructor: skip the check
        return None
    for p in params:
        g = grad_of[id(p)]
        copies[id(p)].grad = None if g is None else g.detach().clone()
    with torch.no_grad():
        shadow.step()
    return [copies[id(p)].detach() for p in params]


def _layer_sums(values: list[float], parts: TrainParts) -> list[float]:
    ids = parts.params.layer_ids.tolist()
    out = [0.0] * len(parts.layers)
    for i, v in zip(ids, values):
        out[i] += v
    return out


def _grad_checks(parts: TrainParts, loss: torch.Tensor, grads: list[torch.Tensor | None]) -> list[Check]:
    params, layers = parts.params.params, parts.layers
    # SYNC: pre-flight runs once, before training: reading the device is fine here.
    sq = [float(g.double().square().sum()) if g is not None else 0.0 for g in grads]
    mx = [float(g.abs().max()) if g is not None and g.numel() else 0.0 for g in grads]
    nonfinite = sum(int((~torch.isfinite(g)).sum()) for g in grads if g is not None)
    loss_v = float(loss)
    checks = []
    if math.isfinite(loss_v) and nonfinite == 0:
        checks.append(Check("nonfinite", "pass", "the loss and every gradient element are finite"))
    else:
        checks.append(Check("nonfinite", "fail", f"loss = {loss_v}, {nonfinite} non-finite gradient element(s)",
                            {"loss": loss_v, "nonfinite_grads": nonfinite}))
    norms = [math.sqrt(v) for v in _layer_sums(sq, parts)]
    layer_max = [0.0] * len(layers)
    for i, v in zip(parts.params.layer_ids.tolist(), mx):
        layer_max[i] = max(layer_max[i], v) if math.isfinite(v) else math.inf
    bad = {layers[i]: {"max_abs": layer_max[i], "norm": norms[i]} for i in range(len(layers))
           if not (layer_max[i] < GRAD_LIMIT and norms[i] < GRAD_LIMIT)}
    worst = max(range(len(layers)), key=lambda i: norms[i] if math.isfinite(norms[i]) else math.inf)
    checks.append(Check(
        "grad_values", "fail" if bad else "pass",
        (f"{len(bad)} layer(s) with gradient values or norms of 1e3 or more: {', '.join(list(bad)[:5])}" if bad else
         f"every layer's gradient values and norm are below 1e3 (largest norm {norms[worst]:.3g} in {layers[worst]!r})"),
        {"layers": bad} if bad else {"largest_norm": norms[worst], "layer": layers[worst]}))
    names = {id(p): n for n, p in parts.model.named_parameters()}
    missing = [names.get(id(p), "?") for p, g in zip(params, grads) if g is None]
    zero = [names.get(id(p), "?") for p, g, v in zip(params, grads, sq) if g is not None and v == 0.0]
    if missing or zero:
        checks.append(Check("no_grad", "warn",
                            f"{len(missing)} parameter(s) get no gradient, {len(zero)} an all-zero one: "
                            f"{', '.join((missing + zero)[:8])}", {"no_gradient": missing[:64], "zero_gradient": zero[:64]}))
    else:
        checks.append(Check("no_grad", "pass", "every trainable parameter gets a non-zero gradient"))
    return checks


def _update_check(parts: TrainParts, grads: list[torch.Tensor | None]) -> Check:
    params, opt = parts.params.params, parts.optimizer
    after = _simulate_step(opt, params, grads)
    if after is None:
        return Check("update_size", "skip", f"{type(opt).__name__} cannot be copied to simulate a step")
    predicted = triage.bound_sq(opt, params, grads)
    if predicted is None:
        return Check("update_size", "skip", f"{type(opt).__name__}'s update rule is not one trainguard knows "
                     f"({triage.KNOWN_RULES}): no predicted update size to compare with")
    rule = triage.update_rule(opt)
    d_sq = [float((a.double() - p.detach().double()).square().sum()) for a, p in zip(after, params)]
    w_sq = [float(p.detach().double().square().sum()) for p in params]
    d, w, b = (_layer_sums(v, parts) for v in (d_sq, w_sq, predicted))
    rows = {}
    for i, layer in enumerate(parts.layers):
        ratio = math.sqrt(d[i] / b[i]) if b[i] > 0 else (0.0 if d[i] == 0 else math.inf)
        rel = math.sqrt(d[i] / w[i]) if w[i] > 0 else (0.0 if d[i] == 0 else math.inf)
        rows[layer] = {"update": math.sqrt(d[i]), "predicted": math.sqrt(b[i]), "ratio": ratio, "update_ratio": rel}
    rule = {"adaptive": "lr x sqrt(n)", "sgd": "lr x ||g|| / (1 - momentum)", "trust_ratio": "lr x ||W|| (trust ratio)",
            "adafactor": "rho_t x d x max(eps2 sqrt(n), ||W||) (relative step)"}[rule]
    off = {k: v for k, v in rows.items() if not v["ratio"] <= 3.0 + 1e-3}
    big = {k: v for k, v in rows.items() if not v["update_ratio"] <= 1e-2}
    if off or big:
        parts = []
        if off:
            parts.append(f"update beyond 3x {rule} in {', '.join(list(off)[:5])}")
        if big:
            parts.append(f"||dW|| / ||W|| above 1e-2 in {', '.join(list(big)[:5])}")
        return Check("update_size", "warn", "; ".join(parts), {"layers": rows})
    return Check("update_size", "pass", f"one simulated step moves every layer within {rule} and by at most 1e-2 of its norm",
                 {"layers": rows})


def _token_ids(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, Mapping):
        batch = batch.get("input_ids")
    if isinstance(batch, torch.Tensor) and not batch.is_floating_point() and not batch.is_complex():
        return batch
    return None


def _data_check(config: AgentConfig, batch: Any) -> Check:
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


def _config_checks(parts: TrainParts, declared_params: int | None, clip_grad_norm: float | None | str) -> list[Check]:
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
        checks.append(Check("grad_scaler", "skip", "no enabled GradScaler"))
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


def _ranks_check(parts: TrainParts, desync_rel_tol: float) -> Check:
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
    dist.all_gather_single(out, row)
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


def _endpoint_checks(url: str | None, controller: str | None, control: Any, rank: int, timeout: float) -> list[Check]:
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


def _probe_checks(parts: TrainParts, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None, step_seconds: float,
                  probe: Mapping[str, Any]) -> list[Check]:
    def run(b: Any, scale: Callable[[torch.Tensor], torch.Tensor] | None = None):
        with torch.enable_grad():
            return forward_backward(parts, b, loss_fn, scale=scale)

    layer_names = parts.layers
    layer_of = {id(p): layer_names[i] for p, i in zip(parts.params.params, parts.params.layer_ids.tolist())}
    ids = probes._ids_of(batch)
    found = [probes.init_check(parts.model, parts.params.params),
             probes.loss_boundary_check(parts.model, batch, run, pad_id=probe.get("pad_id"),
                                        max_length=probe.get("max_length")),
             probes.amp_overflow_check(parts.model, batch, run, lambda p: layer_of.get(id(p), "?"), parts.params.params,
                                       dtype=probe.get("amp_dtype"), scaler=parts.scaler),
             probes.input_pipeline_check(probe.get("loader"), int(ids.numel()) if ids is not None else 0, step_seconds)]
    found += environment.environment_checks(os.environ, environment.EnvFacts.of_process())
    return [Check(name, status, detail, values) for name, status, detail, values in found]


def _probe_options(loader: Any, amp_dtype: Any, pad_id: Any, max_length: Any) -> dict[str, Any]:
    if amp_dtype is not None and amp_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"amp_dtype must be torch.float16 or torch.bfloat16, got {amp_dtype!r}")
    for name, value in (("pad_id", pad_id), ("max_length", max_length)):
        if value is not None and (type(value) is not int or value < (0 if name == "pad_id" else 1)):
            raise ValueError(f"{name} must be {'an integer >= 0' if name == 'pad_id' else 'a positive integer'}, got {value!r}")
    if loader is not None and not hasattr(loader, "__iter__"):
        raise ValueError(f"loader must be iterable (a DataLoader, a TokenLoader), got {type(loader).__name__}")
    return {"loader": loader, "amp_dtype": amp_dtype, "pad_id": pad_id, "max_length": max_length}


def run_preflight(parts: TrainParts, config: AgentConfig, batch: Any,
                  loss_fn: Callable[[nn.Module, Any], Any] | None = None, *,
                  metrics_url: str | None = None, control: Any = None, declared_params: int | None = None, clip_grad_norm: float | None | str = "unknown",
                  timeout: float = 2.0, loader: Any = None, amp_dtype: torch.dtype | None = None,
                  pad_id: int | None = None, max_length: int | None = None) -> PreflightReport:
    """See the module docstring; ``Agent.preflight`` is the entry point. ``parts``: what the pass
    runs on; ``metrics_url`` and ``control`` (the control plane, or None): the endpoints checked."""
    probe = _probe_options(loader, amp_dtype, pad_id, max_length)
    if declared_params is not None and (type(declared_params) is not int or declared_params < 1):
        raise ValueError(f"declared_params must be a positive int, got {declared_params!r}")
    if clip_grad_norm not in (None, "unknown") and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
        raise ValueError(f"clip_grad_norm must be a positive number or None, got {clip_grad_norm!r}")
    step = parts.step()
    if step != 0:
        raise ValueError(f"preflight runs before the first training step (this agent is at step {step})")
    t0 = time.perf_counter()
    loss, grads = forward_backward(parts, batch, loss_fn)
    step_seconds = time.perf_counter() - t0
    with torch.no_grad():
        checks = _grad_checks(parts, loss, grads)
        checks.append(_update_check(parts, grads))
        checks.append(_data_check(config, batch))
        checks += _config_checks(parts, declared_params, clip_grad_norm)
        checks.append(_ranks_check(parts, config.desync_rel_tol))
        checks += _endpoint_checks(metrics_url, config.controller, control, parts.rank, timeout)
        checks += _probe_checks(parts, batch, loss_fn, step_seconds, probe)
    report = PreflightReport(tuple(checks), time.perf_counter() - t0)
    level = logging.WARNING if report.failed or report.warned else logging.INFO
    log.log(level, "trainguard pre-flight (rank %d):\n%s", parts.rank, report.summary())
    return report


def raise_if_fatal(report: PreflightReport, fatal: bool | Iterable[str]) -> None:
    """``RuntimeError`` when a check named in ``fatal`` (every check for True) failed."""
    names = {c.name for c in report.checks} if fatal is True else set(fatal or ())
    failed = [c for c in report.failed if c.name in names]
    if failed:
        raise RuntimeError("trainguard pre-flight failed: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))


def to_wire(report: PreflightReport, rank: int) -> PreflightResult:
    return PreflightResult(rank=rank, seconds=report.seconds,
                           checks=[PreflightCheck(name=c.name, status=c.status, detail=c.detail[:2000])
                                   for c in report.checks])
