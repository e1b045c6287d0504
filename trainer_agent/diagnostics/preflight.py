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
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from trainer_agent.diagnostics import environment, preflight_probes as probes
from trainer_agent.config import AgentConfig
from trainer_agent.diagnostics.preflight_gradients import GRAD_LIMIT, forward_backward, grad_checks, update_check
from trainer_agent.diagnostics.preflight_report import (PREFLIGHT_ONLY_ENV, Check, PreflightOnly, PreflightReport,
                                                        Status, raise_if_fatal, to_wire)
from trainer_agent.diagnostics.preflight_setup import (BIG_MODEL_PARAMS, config_checks, data_check, endpoint_checks,
                                                       ranks_check)
from trainer_agent.measure.train_parts import TrainParts

__all__ = ["Check", "PreflightReport", "PreflightOnly", "PREFLIGHT_ONLY_ENV", "Status", "forward_backward", "run_preflight",
           "raise_if_fatal", "to_wire", "GRAD_LIMIT", "BIG_MODEL_PARAMS"]

log = logging.getLogger(__name__)


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
        checks = grad_checks(parts, loss, grads)
        checks.append(update_check(parts, grads))
        checks.append(data_check(config, batch))
        checks += config_checks(parts, declared_params, clip_grad_norm)
        checks.append(ranks_check(parts, config.desync_rel_tol))
        checks += endpoint_checks(metrics_url, config.controller, control, parts.rank, timeout)
        checks += _probe_checks(parts, batch, loss_fn, step_seconds, probe)
    report = PreflightReport(tuple(checks), time.perf_counter() - t0)
    level = logging.WARNING if report.failed or report.warned else logging.INFO
    log.log(level, "trainguard pre-flight (rank %d):\n%s", parts.rank, report.summary())
    return report

