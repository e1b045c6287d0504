"""The pre-flight checks that look past the one real batch (``trainer_agent/diagnostics/preflight.py`` runs
them): how the weights start, how the loss behaves at the edges of its inputs, how the model runs
in its mixed-precision dtype, and whether the input pipeline keeps up with the step.

=====================  =======================================================================
``init_distribution``  per weight matrix (2 or more dims, embeddings apart): std x sqrt(fan_in)
                       within [0.05, 5] (the usual schemes give 0.02 x sqrt(d) ... sqrt(2); far
                       outside, activations shrink or grow by that factor at every layer), a
                       mean within half a std of 0, not constant (warn otherwise); non-finite
                       values fail
``loss_boundary``      a forward and backward on extreme inputs, each with a finite loss and
                       gradients (fail naming the input otherwise): a single repeated token, all
                       padding (with a ``pad_id`` or an attention mask), the maximum length
                       (``max_length`` or the model config's), the largest logits (a forward
                       hook on the output layer sets one logit per position to the largest
                       16-bit value, or to sqrt(max) of a 32/64-bit dtype, whose loss itself
                       would not be representable); token batches only (skip otherwise)
``amp_overflow``       a forward and backward under ``torch.autocast`` in the run's dtype
                       (float16 with an enabled GradScaler, or ``amp_dtype``): per module,
                       non-finite outputs fail; activations within 8x of the dtype's largest
                       value warn; non-finite gradients fail without a scaler and warn with one
                       (it skips the step and lowers its scale)
``input_pipeline``     ``loader`` drawn from a fresh iterator (its position, generators and the
                       RNG restored after): tokens/s against what a step consumes (the batch's
                       tokens over one forward and backward): fail below, warn below 1.5x; and
                       its prefetch depth, 4 to 8 batches ready (warn below 4)
=====================  =======================================================================

Each forward and backward goes through ``forward_backward``, which leaves the weights, their
gradients, the buffers and the random number generators as they were.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from trainer_agent.measure.module_hooks import add_forward_hook
from trainer_agent.measure.sharding import local

__all__ = ["init_check", "loss_boundary_check", "amp_overflow_check", "input_pipeline_check",
           "INIT_RATIO_RANGE", "HEADROOM"]

#: The range of std x sqrt(fan_in) a weight matrix should start in.
INIT_RATIO_RANGE = (0.05, 5.0)
#: Activations within this factor of the dtype's largest value leave no headroom.
HEADROOM = 8.0
#: How many batches (after the first) the input pipeline check draws, and its time budget (s).
PIPELINE_BATCHES = 8
PIPELINE_BUDGET_S = 5.0

CheckTuple = tuple[str, str, str, dict]
ForwardBackward = Callable[..., tuple[torch.Tensor, list[torch.Tensor | None]]]


def _fan_in(shape: torch.Size) -> int:
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    return int(shape[1]) * receptive


def init_check(model: nn.Module, params: list[torch.Tensor]) -> CheckTuple:
    names = {id(p): n for n, p in model.named_parameters()}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    rows, warn, fail = {}, [], []
    low, high = INIT_RATIO_RANGE
    for p in params:
        if p.dim() < 2 or id(p) in embeddings or p.is_meta:
            continue
        name = names.get(id(p), "?")
        # SYNC: pre-flight runs once, before training: reading the device is fine here.
        values = local(p).detach().double()
        if not bool(torch.isfinite(values).all()):
            fail.append(name)
            rows[name] = {"nonfinite": True}
            continue
        std, mean = float(values.std()) if values.numel() > 1 else 0.0, float(values.mean())
        ratio = std * math.sqrt(_fan_in(p.shape))
        rows[name] = {"mean": mean, "std": std, "fan_in": _fan_in(p.shape), "std_x_sqrt_fan_in": ratio}
        if std == 0.0:
            warn.append(f"{name} is constant ({mean:g}): every unit gets the same gradient and they never differ")
        elif not low <= ratio <= high:
            warn.append(f"{name}: std x sqrt(fan_in) = {ratio:.3g} (std {std:.3g}, fan-in {_fan_in(p.shape)}), outside "
                        f"[{low:g}, {high:g}]: activations {'shrink' if ratio < low else 'grow'} by about that factor per layer")
        elif abs(mean) > 0.5 * std:
            warn.append(f"{name}: mean {mean:.3g} is more than half its std {std:.3g} away from 0")
    if not rows:
        return "init_distribution", "skip", "no weight matrix outside the embeddings", {}
    if fail:
        return "init_distribution", "fail", f"non-finite initial values in {', '.join(fail[:5])}", {"layers": rows}
    if warn:
        return "init_distribution", "warn", "; ".join(warn[:5]) + (f" (and {len(warn) - 5} more)" if len(warn) > 5 else ""), \
            {"layers": rows}
    return ("init_distribution", "pass", f"{len(rows)} weight matrices start centred with std x sqrt(fan_in) in "
            f"[{low:g}, {high:g}]", {"layers": rows})


def _ids_of(batch: Any) -> torch.Tensor | None:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1 and not ids.is_floating_point() and not ids.is_complex():
        return ids
    return None


def _with_ids(batch: Any, ids: torch.Tensor, *, mask: float | None = None, labels: str = "ids") -> Any:
    """``batch`` with its token ids replaced (same other keys, resized to ``ids``' shape)."""
    if not isinstance(batch, Mapping):
        return ids
    out = dict(batch)
    out["input_ids"] = ids
    if "attention_mask" in batch:
        out["attention_mask"] = torch.full_like(ids, 1 if mask is None else int(mask))
    if "labels" in batch:
        out["labels"] = ids.clone() if labels == "ids" else torch.full_like(ids, -100)
    if "position_ids" in batch:
        out["position_ids"] = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids).clone()
    return out


def _max_length(model: nn.Module, max_length: int | None) -> int | None:
    if max_length is not None:
        return max_length
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "block_size"):
        value = getattr(config, key, None)
        if type(value) is int and value > 0:
            return value
    return None


def _output_layer(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    out = getter() if callable(getter) else None
    if isinstance(out, nn.Module):
        return out
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None


def _largest_logit(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return float(info.max) if info.bits <= 16 else math.sqrt(float(info.max))


def _finite(loss: torch.Tensor, grads: list[torch.Tensor | None]) -> tuple[bool, float, int]:
    # SYNC: pre-flight runs once, before training.
    bad = sum(int((~torch.isfinite(g)).sum()) for g in grads if g is not None)
    value = float(loss)
    return math.isfinite(value) and bad == 0, value, bad


def _try(run: ForwardBackward, make: Callable[[], Any]) -> dict:
    try:
        loss, grads = run(make())
    except (RuntimeError, ValueError) as exc:  # e.g. out of memory at the maximum length
        if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"finite": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    ok, value, bad = _finite(loss, grads)
    return {"loss": value, "nonfinite_grads": bad, "finite": ok}


def loss_boundary_check(model: nn.Module, batch: Any, run: ForwardBackward, *, pad_id: int | None,
                        max_length: int | None) -> CheckTuple:
    ids = _ids_of(batch)
    if ids is None:
        return "loss_boundary", "skip", "the batch holds no token ids (a tensor of ints, or input_ids)", {}
    rows = ids.reshape(-1, ids.shape[-1])
    common = int(torch.mode(rows.reshape(-1).cpu()).values)
    cases: dict[str, Callable[[], Any]] = {
        "a single repeated token": lambda: _with_ids(batch, torch.full_like(ids, common)),
    }
    if pad_id is not None or (isinstance(batch, Mapping) and "attention_mask" in batch):
        fill = pad_id if pad_id is not None else common
        cases["all padding"] = lambda: _with_ids(batch, torch.full_like(ids, fill), mask=0.0, labels="ignore")
    longest = _max_length(model, max_length)
    if longest is not None and ids.dim() == 2:
        first = rows[:1]
        reps = -(-longest // first.shape[-1])
        cases[f"the maximum length ({longest})"] = lambda: _with_ids(batch, first.repeat(1, reps)[:, :longest].contiguous())
    head = _output_layer(model)
    skipped = [] if longest is not None else ["the maximum length (pass max_length=)"]
    results: dict[str, dict] = {name: _try(run, make) for name, make in cases.items()}
    if head is not None:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> Any:
            if not isinstance(output, torch.Tensor) or not output.is_floating_point():
                return output
            index = torch.zeros(1, dtype=torch.long, device=output.device)
            return output.index_fill(-1, index, _largest_logit(output.dtype))

        handle = add_forward_hook(head, hook)
        try:
            results["the largest logits"] = _try(run, lambda: batch)
        finally:
            handle.remove()
    else:
        skipped.append("the largest logits (no output layer found)")
    broken = [n for n, r in results.items() if not r["finite"]]
    values = {"inputs": results, "not_tried": skipped}
    if broken:
        # An all-padding batch is one a pipeline can avoid: a warning; the others are inputs the
        # model meets in training (a short document's repeats, the longest sequence, a confident logit).
        status = "warn" if broken == ["all padding"] else "fail"
        return ("loss_boundary", status, "non-finite loss or gradients on " + ", ".join(
            f"{n} ({results[n]['error']})" if "error" in results[n] else
            f"{n} (loss {results[n]['loss']:g}, {results[n]['nonfinite_grads']} non-finite gradient elements)"
            for n in broken), values)
    detail = f"finite loss and gradients on {', '.join(results)}"
    return "loss_boundary", "pass", detail + (f"; not tried: {', '.join(skipped)}" if skipped else ""), values


def amp_overflow_check(model: nn.Module, batch: Any, run: ForwardBackward, layer_of: Callable[[torch.Tensor], str],
                       params: list[torch.Tensor], *, dtype: torch.dtype | None, scaler: Any) -> CheckTuple:
    scaled = scaler is not None and scaler.is_enabled()
    if dtype is None and not scaled:
        return "amp_overflow", "skip", "no mixed precision: pass amp_dtype= (torch.float16 or torch.bfloat16)", {}
    dtype = dtype or torch.float16
    device = next((p.device for p in params), torch.device("cpu"))
    limit = float(torch.finfo(dtype).max)
    seen: dict[str, list[torch.Tensor]] = {}
    names = {m: n for n, m in model.named_modules()}

    def hook(module: nn.Module, _inputs: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel():
            out = output.detach()
            seen.setdefault(names.get(module, "?"), []).extend(
                [(~torch.isfinite(out)).sum(), out.abs().nan_to_num(0.0, posinf=0.0).amax().float()])

    handles = [add_forward_hook(m, hook) for m in model.modules() if not list(m.children())]
    try:
        with torch.autocast(device_type=device.type, dtype=dtype):
            scale = None
            if scaled:
                factor = scaler.get_scale() if hasattr(scaler, "get_scale") else 1.0
                scale = (lambda loss: loss * factor)  # noqa: E731 - the scaler's current scale
            loss, grads = run(batch, scale=scale)
    finally:
        for h in handles:
            h.remove()
    values = {"dtype": str(dtype).removeprefix("torch."), **_amp_findings(seen, params, grads, layer_of, limit),
              "loss": float(loss)}
    return _amp_verdict(values, scaled)


def _amp_findings(seen: dict[str, list[torch.Tensor]], params: list[torch.Tensor], grads: Any,
                  layer_of: Callable[[torch.Tensor], str], limit: float) -> dict[str, Any]:
    """What the mixed-precision pass saw: per module the non-finite outputs and the activations near
    the dtype's limit, per layer the non-finite gradient elements."""
    # SYNC: pre-flight runs once, before training.
    overflow = {n: int(sum(v[0::2])) for n, v in seen.items() if int(sum(v[0::2]))}
    peak = {n: max(float(x) for x in v[1::2]) for n, v in seen.items()}
    tight = [n for n, m in peak.items() if m * HEADROOM > limit and n not in overflow]
    grad_bad: dict[str, int] = {}
    for p, g in zip(params, grads):
        if g is not None:
            n = int((~torch.isfinite(g)).sum())
            if n:
                grad_bad[layer_of(p)] = grad_bad.get(layer_of(p), 0) + n
    return {"forward_overflow": overflow, "near_limit": tight, "grad_overflow": grad_bad}


def _amp_verdict(values: dict[str, Any], scaled: bool) -> CheckTuple:
    kind, overflow, grad_bad, tight = values["dtype"], values["forward_overflow"], values["grad_overflow"], values["near_limit"]
    if overflow:
        return "amp_overflow", "fail", f"{kind} overflows in the forward pass of {', '.join(list(overflow)[:5])}", values
    if grad_bad and not scaled:
        return ("amp_overflow", "fail", f"{kind} gradients overflow in {', '.join(list(grad_bad)[:5])} without a loss "
                "scaler (if the loop uses a GradScaler, pass it to attach as scaler=)", values)
    problems = []
    if grad_bad:
        problems.append(f"gradients overflow at the scaler's scale in {', '.join(list(grad_bad)[:5])}: it will skip "
                        "steps and lower its scale")
    if tight:
        problems.append(f"activations within {HEADROOM:g}x of {kind}'s largest value in {', '.join(tight[:5])}")
    if problems:
        return "amp_overflow", "warn", "; ".join(problems), values
    return "amp_overflow", "pass", f"a forward and backward in {kind} stay finite, activations with headroom", values


def _tokens_in(item: Any) -> int:
    if isinstance(item, Mapping):
        if isinstance(item.get("tokens"), int):
            return item["tokens"]
        item = item.get("input_ids")
    if isinstance(item, (list, tuple)) and item:
        item = item[0]
    return int(item.numel()) if isinstance(item, torch.Tensor) else 0


def _prefetch_depth(loader: Any) -> int | None:
    if isinstance(getattr(loader, "prefetch", None), int):
        return loader.prefetch  # trainguard's TokenLoader: batches its thread keeps ready
    workers = getattr(loader, "num_workers", None)
    if isinstance(workers, int):
        return workers * (getattr(loader, "prefetch_factor", None) or 2) if workers else 0
    return None


def _generators(loader: Any) -> list[torch.Generator]:
    found = []
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        gen = getattr(obj, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in found):
            found.append(gen)
    return found


def _draw(loader: Iterable[Any], clock: Callable[[], float]) -> tuple[int, int, float]:
    """(batches after the first, their tokens, seconds they took) from a fresh iterator."""
    it = iter(loader)
    try:
        next(it)  # the first batch pays the workers' start: not the steady rate
        start, tokens, count = clock(), 0, 0
        while count < PIPELINE_BATCHES and clock() - start < PIPELINE_BUDGET_S:
            try:
                tokens += _tokens_in(next(it))
            except StopIteration:
                break
            count += 1
        return count, tokens, clock() - start
    finally:
        close = getattr(it, "close", None)
        if callable(close):
            close()
        del it


def input_pipeline_check(loader: Any, step_tokens: int, step_seconds: float,
                         clock: Callable[[], float] = time.perf_counter) -> CheckTuple:
    if loader is None:
        return "input_pipeline", "skip", "no loader: pass loader= (the DataLoader or TokenLoader the loop reads)", {}
    if isinstance(loader, Iterator):
        return ("input_pipeline", "skip", "the loader is an iterator: drawing from it would take batches from training; "
                "pass the re-iterable loader (a DataLoader, a TokenLoader)", {})
    saved = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "generators": [(g, g.get_state()) for g in _generators(loader)],
             "loader": loader.state_dict() if callable(getattr(loader, "state_dict", None)) else None}
    try:
        import numpy as np
        saved["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = None
    try:
        count, tokens, seconds = _draw(loader, clock)
    finally:
        torch.set_rng_state(saved["torch"])
        random.setstate(saved["python"])
        if np is not None:
            np.random.set_state(saved["numpy"])
        for gen, state in saved["generators"]:
            gen.set_state(state)
        if saved["loader"] is not None:
            loader.load_state_dict(saved["loader"])
    depth = _prefetch_depth(loader)
    values: dict[str, Any] = {"batches": count, "prefetch_batches": depth}
    if count == 0 or tokens == 0 or seconds <= 0:
        return "input_pipeline", "skip", "the loader gave fewer than two batches of token ids to time", values
    rate, demand = tokens / seconds, step_tokens / step_seconds if step_seconds > 0 else math.inf
    values.update(tokens_per_second=rate, step_tokens_per_second=demand)
    problems, status = [], "pass"
    if rate < demand:
        status = "fail"
        problems.append(f"the loader delivers {rate:,.0f} tokens/s, a step consumes {demand:,.0f}: training will wait for input")
    elif rate < 1.5 * demand:
        status = "warn"
        problems.append(f"the loader delivers {rate:,.0f} tokens/s, only {rate / demand:.2f}x the {demand:,.0f} a step consumes")
    if depth is not None and depth < 4:
        status = "warn" if status == "pass" else status
        problems.append(f"{depth} batch(es) prefetched: keep 4 to 8 batches ready (more workers or a larger prefetch)")
    if problems:
        return "input_pipeline", status, "; ".join(problems), values
    return ("input_pipeline", "pass", f"the loader delivers {rate:,.0f} tokens/s, {rate / demand:.1f}x what a step consumes"
            + (f", {depth} batches prefetched" if depth is not None else ""), values)
