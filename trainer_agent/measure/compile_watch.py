"""Steps whose wall time held a torch.compile compilation (``trainguard_compile_steps_total``).

A compilation after the first step (a new input shape, a guard that failed mid-run, a function
compiled at its first call, ``torch.compiler.reset()``) takes from a fraction of a second to
minutes, tens to thousands of times a step: that step's time is the compiler's, not a sign of a
slow rank. The agent leaves such a step out of its step timings, as it leaves out the first step
after attach (``StepClock.warm_up``): its report has no step time, throughput, MFU or forward
time, and its gradient communication is not counted (``CommTiming.step_ended``).

How it is known: a callback in TorchDynamo's list of compile-end callbacks
(``trainer_agent/compat/torch_dynamo.py``) counts the compilations as they end; the end of a step
compares the count with the one it saw last. Per step that is an integer comparison and a look in
a list of a few callbacks (is the agent's still there: ``torch.compiler.reset()`` empties it, and
what was compiled is compiled again at the next call, so the step of the reset counts as compiled
and the callback goes back in). The callback goes in at attach where ``torch._dynamo`` is
imported by then (constructing a torch optimizer imports it); where it is not, the agent does not
import it (seconds) and registers at the end of the step in which it appears, which counts as
compiled (torch.compile's first use: the import and the first compilation). A compilation in
another thread of the process (an evaluation compiled there) marks the training step it overlaps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from trainer_agent.compat import PrivateMemberMissing, torch_dynamo

__all__ = ["CompileWatch"]


class CompileWatch:
    """``on_error(kind, exc)`` counts and logs the agent's errors (a missing member: once)."""

    def __init__(self, on_error: Callable[[str, BaseException], None]) -> None:
        self._on_error = on_error
        #: Compilations ended since the callback went in (counted by :meth:`_ended`).
        self.compilations = 0
        self._seen = 0
        #: Steps after the warm-up whose time held a compilation (``trainguard_compile_steps_total``).
        self.compile_steps = 0
        self._callback = self._ended  # one bound method: the object found (and removed) in the list
        self._callbacks: list[Callable[..., object]] | None = None
        self._watching = True  # False once closed, or where the member is gone
        self._register()

    def _ended(self, *args: object) -> None:
        self.compilations += 1

    def _register(self) -> bool:
        """Put the callback in TorchDynamo's list once ``torch._dynamo`` is imported; True when it went in now."""
        try:
            callbacks = torch_dynamo.compile_end_callbacks()
        except PrivateMemberMissing as exc:
            self._watching = False
            self._on_error("compile_watch", exc)
            return False
        if callbacks is None:
            return False
        callbacks.append(self._callback)
        self._callbacks = callbacks
        return True

    def step_ended(self, warm_up: bool) -> bool:
        """Whether the step ending now held a compilation (since the last call); counted in
        :attr:`compile_steps` unless it is the warm-up step, whose time is left out anyway."""
        callbacks = self._callbacks
        if callbacks is None:  # torch._dynamo imported during this step: torch.compile's first use
            compiled = self._watching and "torch._dynamo" in sys.modules and self._register()
        elif self._callback not in callbacks:  # emptied by torch.compiler.reset(): all is compiled anew
            callbacks.append(self._callback)
            compiled = True
        else:
            compiled = self.compilations != self._seen
        self._seen = self.compilations
        if compiled and not warm_up:
            self.compile_steps += 1
        return compiled

    def remove(self) -> None:
        """Stop watching (the agent closes): the callback leaves TorchDynamo's list."""
        callbacks, self._callbacks, self._watching = self._callbacks, None, False
        if callbacks is not None and self._callback in callbacks:
            callbacks.remove(self._callback)
