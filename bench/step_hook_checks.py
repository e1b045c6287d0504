"""What the agent's per-step checks added for GradScalers and parameter sets cost, side by side.

    .venv/bin/python bench/step_hook_checks.py

Two checks run on every optimizer step or report step of every run:

- ``AgentHooks.find_scaler`` (``torch_private.stepping_grad_scaler``): from the optimizer's step
  hooks, the caller's frames are read for a ``GradScaler`` not passed to ``attach``, until one is
  found. Timed inside a real optimizer pre-hook (the frames it walks are the real ones), beside an
  empty call in the same hook, for a plain ``optimizer.step()`` (no scaler: the search runs every
  step) and under ``GradScaler.step`` (found, then never again).
- ``ParamIndex.unmeasured`` on report steps: whether the optimizer holds trainable parameters it
  did not hold at attach. Its fast path (per param group, and per parameter frozen at attach)
  beside the full pass over every parameter it falls back to, at 100 and 5,000 tensors.
- ``checked_end_step`` on every ``end_step``: the loss and token count checked, beside an empty
  call; ``torch_private.join_allows_uneven_inputs`` on report steps (a DDP model outside Join);
  and the ``ModuleHook`` wrapper around each of the agent's forward hooks, beside the bare hook.
- ``ScheduledLr``: ``observe`` in every step's pre-hook (the groups' LRs) beside ``take`` once per
  report, which reads the groups' ``initial_lr`` for the envelope, at 1 and 100 param groups.

Best of 5 rounds of 1,000 calls each, thread CPU time, one thread.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from trainer_agent.agent_parts.attach_args import checked_end_step
from trainer_agent.compat import torch_private
from trainer_agent.measure.module_hooks import ModuleHook
from trainer_agent.measure.params import ParamIndex
from trainer_agent.measure.schedule import ScheduledLr

ROUNDS, CALLS = 5, 1000


def _per_call_us(fn) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.thread_time()
        for _ in range(CALLS):
            fn()
        best = min(best, time.thread_time() - t0)
    return best / CALLS * 1e6


def _in_pre_hook(scaled: bool) -> tuple[float, float]:
    """(search, empty call) in µs per call, timed inside the optimizer's pre-step hook."""
    w = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.0)
    seen: dict[str, float] = {}

    def hook(o, a, k):  # noqa: ANN001
        seen["search"] = _per_call_us(torch_private.stepping_grad_scaler)
        seen["empty"] = _per_call_us(lambda: None)

    opt.register_step_pre_hook(hook)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    loss = w.sum()
    (scaler.scale(loss) if scaler else loss).backward()
    scaler.step(opt) if scaler else opt.step()
    return seen["search"], seen["empty"]


def _unmeasured(tensors: int) -> tuple[float, float]:
    """(fast path, full pass) in µs per call, ``tensors`` trainable parameters."""
    model = nn.ParameterList([nn.Parameter(torch.zeros(4)) for _ in range(tensors)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    index = ParamIndex(model, opt)
    fast = _per_call_us(lambda: index.unmeasured(opt))
    attached = frozenset(id(p) for p in model.parameters())
    full = _per_call_us(lambda: sum(1 for g in opt.param_groups for p in g["params"]
                                    if p.requires_grad and id(p) not in attached))
    return fast, full


def main() -> None:
    torch.set_num_threads(1)
    print("check | case | µs per call | beside it | µs")
    for scaled in (False, True):
        search, empty = _in_pre_hook(scaled)
        case = "under GradScaler.step" if scaled else "plain optimizer.step()"
        print(f"find_scaler's frame search | {case} | {search:.2f} | an empty call | {empty:.2f}")
    for tensors in (100, 5000):
        fast, full = _unmeasured(tensors)
        print(f"unmeasured() | {tensors:,} tensors | {fast:.2f} | the full pass | {full:.2f}")
    loss, empty = torch.tensor(2.0), _per_call_us(lambda: None)
    for case, tokens in (("loss tensor, tokens=None", None), ("loss tensor, tokens=4096", 4096),
                         ("loss tensor, tokens in a tensor", torch.tensor(4096))):
        print(f"checked_end_step | {case} | {_per_call_us(lambda: checked_end_step(loss, tokens)):.2f} "
              f"| an empty call | {empty:.2f}")
    model = nn.Linear(2, 2)
    print(f"join_allows_uneven_inputs | a module outside Join | "
          f"{_per_call_us(lambda: torch_private.join_allows_uneven_inputs(model)):.2f} | an empty call | {empty:.2f}")

    def bare(module: nn.Module, args: object) -> None:
        return None

    wrapped = ModuleHook(bare)
    print(f"ModuleHook | a forward pre-hook call | {_per_call_us(lambda: wrapped(model, ())):.2f} "
          f"| the bare hook | {_per_call_us(lambda: bare(model, ())):.2f}")
    for groups in (1, 100):
        params = [nn.Parameter(torch.zeros(1)) for _ in range(groups)]
        opt = torch.optim.AdamW([{"params": [p], "lr": 1e-3 * (i + 1)} for i, p in enumerate(params)])
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # sets every group's initial_lr
        lr = ScheduledLr(min_steps=1)
        observe = _per_call_us(lambda: lr.observe(opt))
        print(f"ScheduledLr.observe | {groups} param group(s), every step | {observe:.2f} | take(optimizer), "
              f"once per report | {_per_call_us(lambda: (lr.observe(opt), lr.take(opt))) - observe:.2f}")


if __name__ == "__main__":
    main()
