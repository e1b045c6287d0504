"""The checks ``attach`` and ``end_step`` make of their arguments (``trainer_agent/agent.py``): a
mistake raises ``ValueError`` before training starts, or at the first ``end_step``."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from pydantic import TypeAdapter, ValidationError
from torch import nn

from trainguard.protocol.wire import Name
from trainer_agent.measure import optim
from trainer_agent.config import AgentConfig

__all__ = ["checked_args", "checked_end_step", "checked_loader", "is_token_count"]

_NAME = TypeAdapter(Name)


def checked_args(model: Any, optimizer: Any, *, job: str, run: str, scaler: Any, config: AgentConfig | None,
                 controller: str | None, token: str | None, lr_scheduler: Any, data_monitor: Any,
                 loader: Any) -> tuple[Any, AgentConfig]:
    """The real optimizer (``optim.unwrap_optimizer``) and the config ``attach`` runs with
    (``controller``/``token`` override the config's); ``ValueError`` for an argument it cannot take."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    optimizer = optim.unwrap_optimizer(optimizer)  # ValueError naming what was passed
    _shares_parameters(model, optimizer)
    for what, value in (("job", job), ("run", run)):
        try:
            _NAME.validate_python(value)
        except ValidationError:
            raise ValueError(f"{what} must match [A-Za-z0-9][A-Za-z0-9._:-]{{0,127}}, got {value!r}") from None
    if scaler is not None and not (hasattr(scaler, "is_enabled") and hasattr(scaler, "step")):
        raise ValueError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if config is None:
        config = AgentConfig()
    elif not isinstance(config, AgentConfig):
        raise ValueError(f"config must be an AgentConfig, got {type(config).__name__}")
    else:
        config.validate()  # (a setting changed since the config was made)
    if controller is not None or token is not None:
        config = replace(config, controller=controller if controller is not None else config.controller,
                         token=token if token is not None else config.token)
    if lr_scheduler is not None and not (hasattr(lr_scheduler, "state_dict") and hasattr(lr_scheduler, "load_state_dict")):
        raise ValueError(f"lr_scheduler must have state_dict() and load_state_dict(), got {type(lr_scheduler).__name__}")
    if data_monitor is not None and not (hasattr(data_monitor, "observe_batch") and hasattr(data_monitor, "values")):
        raise ValueError("data_monitor must have observe_batch() and values() (trainer_agent.DataMonitor)")
    if loader is not None:
        checked_loader(loader)
    return optimizer, config


def _shares_parameters(model: nn.Module, optimizer: Any) -> None:
    """``ValueError`` when the optimizer updates none of the model's parameters (another model's
    optimizer, or a model without parameters): the agent would measure gradients nobody makes."""
    own = {id(p) for p in model.parameters()}
    held = [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]
    if held and not any(id(p) in own for p in held):
        raise ValueError(f"the optimizer holds none of the model's parameters ({len(own)} in the model, {len(held)} in "
                         "the optimizer): pass the model the optimizer trains (the same object, or its DDP/FSDP wrapper)")


def checked_loader(loader: Any) -> Any:
    if not callable(getattr(loader, "values", None)):
        raise ValueError(f"loader must have values() (trainer_agent.data.sharded_dataset.TokenLoader), got {type(loader).__name__}")
    return loader


def checked_end_step(loss: Any, tokens: Any) -> tuple[torch.Tensor | float | None, Any]:
    """``end_step``'s loss (a tensor of one element, the float of a real number, or None: a step
    without a loss) and token count
    (None, a non-negative number, or a tensor of one element, which is read on report steps only);
    ``ValueError`` for what cannot be either. NaN and Inf losses are values: they pass."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1 or loss.is_complex() or loss.dtype == torch.bool:
            raise ValueError(f"loss must be the step's loss, one real value (e.g. loss.mean()), got a tensor of shape "
                             f"{tuple(loss.shape)} and dtype {loss.dtype}")
    elif loss is None:
        pass
    elif isinstance(loss, (str, bytes, bool)):
        raise ValueError(f"loss must be a tensor of one element, a real number or None, got {loss!r}")
    else:
        try:
            loss = float(loss)
        except (TypeError, ValueError):
            raise ValueError(f"loss must be a tensor of one element or a real number, got {type(loss).__name__}") from None
        except OverflowError:  # (an int beyond float64)
            raise ValueError(f"loss must be a real number within float64's range, got an int of {len(str(loss))} digits") from None
    if tokens is None:
        return loss, None
    if isinstance(tokens, torch.Tensor):
        if tokens.numel() != 1 or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be this rank's token count, one value, got a tensor of shape "
                             f"{tuple(tokens.shape)} and dtype {tokens.dtype}")
        return loss, tokens
    if isinstance(tokens, (str, bytes, bool)) or not is_token_count(tokens):
        raise ValueError(f"tokens must be this rank's token count, a non-negative number, got {tokens!r}")
    return loss, tokens if type(tokens) is int else float(tokens)


def is_token_count(value: Any) -> bool:
    """Whether ``value`` reads as a token count: a finite, non-negative number."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return False
    return number >= 0 and not math.isinf(number)
