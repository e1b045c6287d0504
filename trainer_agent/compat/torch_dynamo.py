"""The private member of torch.compile the agent uses: the list of callbacks TorchDynamo calls when
a compilation ends (``torch._dynamo.callback.callback_handler.end_callbacks``; torch 2.13 has no
public compile-event API), so that a step whose wall time held a compilation is told apart from a
slow step (``trainer_agent/measure/compile_watch.py``). The other private torch members are in
``trainer_agent/compat/torch_private.py``, ``torch_hooks.py`` and ``torch_ddp.py``. The member's
test is in ``tests/agent/test_torch_dynamo.py``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from trainer_agent.compat import PrivateMember, PrivateMemberMissing, degraded

__all__ = ["compile_end_callbacks"]

#: The releases the member below was checked against (tests/agent/test_torch_dynamo.py passed on them).
CHECKED_VERSIONS = {"torch": "2.13.0"}

PRIVATE_MEMBERS = (
    PrivateMember("torch._dynamo.callback.callback_handler.end_callbacks", "_dynamo", "compile_end_callbacks",
                  "test_compile_end_callbacks_run_once_per_compilation"),
)


def compile_end_callbacks() -> list[Callable[..., Any]] | None:
    """The live list of callbacks called (with one argument, the compilation's ``CallbackArgs``) at
    the end of each outermost compilation of torch.compile: a frame traced by Dynamo (a first call,
    a recompile after a guard failed), a backward compiled at its first run, a CUDA graph recorded.
    Append to it to register, remove to unregister; ``torch.compiler.reset()`` empties it.

    None while ``torch._dynamo`` is not imported: importing it takes seconds, which the agent does
    not add (torch.compile, and the construction of a torch optimizer, import it). ``PrivateMemberMissing``
    where the member is gone (logged once: steps that compiled are then reported as steps)."""
    if "torch._dynamo" not in sys.modules:
        return None
    try:
        from torch._dynamo.callback import callback_handler

        callbacks = callback_handler.end_callbacks
    except Exception:  # gone, or torch._dynamo failed to import: nothing to watch
        callbacks = None
    if not isinstance(callbacks, list):
        degraded("torch._dynamo.callback.callback_handler.end_callbacks",
                 "steps in which torch.compile compiled are not told apart: their time counts as a step's")
        raise PrivateMemberMissing("torch._dynamo.callback.callback_handler.end_callbacks is gone")
    return callbacks
