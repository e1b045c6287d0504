"""The pre-flight's pass over the real batch (``trainer_agent/diagnostics/preflight.py`` runs it): one
forward/backward that leaves the training state as it was, the checks of the gradients it produced
(``nonfinite``, ``grad_values``, ``no_grad``), and one simulated optimizer step on copies, checked
against the optimizer's update rule (``update_size``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from trainer_agent.diagnostics.preflight_report import Check
from trainer_agent.measure import triage_stats as triage
from trainer_agent.measure.train_parts import TrainParts

__all__ = ["GRAD_LIMIT", "forward_backward", "grad_checks", "update_check"]

#: Gradient values and norms should stay below this (the stability guide, 6.1).
GRAD_LIMIT = 1e3


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


def grad_checks(parts: TrainParts, loss: torch.Tensor, grads: list[torch.Tensor | None]) -> list[Check]:
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


def update_check(parts: TrainParts, grads: list[torch.Tensor | None]) -> Check:
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
            "adafactor": "rho_t x d x max(eps2 sqrt(n), ||W||) (relative step)",
            "orthogonal": "lr x r x sqrt(min(A, B)) (orthogonalised momentum)"}[rule]
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
