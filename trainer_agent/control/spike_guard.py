"""The in-rank spike guard: is this step's gradient norm far above the recent ones?

In the spirit of OLMo-core's skip-step optimizer (a step whose loss or gradient norm is more than
6 sigma over the last 128 steps is not taken), with robust statistics: the median and the median
absolute deviation (MAD) of the global gradient norms of the last ``window`` steps *taken*. A
step is a spike when its norm exceeds both ``median + sigmas * 1.4826 * MAD`` (1.4826 x MAD is
the standard deviation of a normal sample) and ``min_ratio * median`` (a run whose norms barely
move has a tiny MAD; a 10 % bump is not a spike). Nothing is decided before ``min_history`` steps
were taken.

The decision is made at ``optimizer.step`` time, from the gradient norm the agent measured at the
end of backward (already read by the non-finite check: no extra device read). The loss of the
step is not known then (it reaches the agent in ``end_step``, after the step), so a loss spike
with an ordinary gradient norm is not skipped here: the controller's ``loss_spike`` rule sees it
in the next report and acts (adaptive LR, rollback). A bad batch whose loss spikes almost always
spikes the gradient norm too, and that is skipped here.

Two kinds of large norm are the run's own, not a batch's, and are taken:

- A *climb*: a norm above the threshold but at most ``min_jump`` (2x) the largest norm of the last
  3 steps taken. A bad batch jumps at once; a gradient norm that rises step by step is the model
  leaving its initialization or a schedule moving it. A diffusion model's norm rises 25x over its
  first 40 steps while its loss falls, never more than 1.6x from one step to the next: judged
  against the median alone, its first 16 steps after ``min_history`` were skipped in a row. Not
  while the LR the schedule asks for jumped above every LR the run trained at or was built on
  (more than 4x, the built-in rule ``scheduler_lr_jump``'s limit: ``lr_jumped``,
  ``ScheduledLr.above_envelope``): a schedule that jumped 10x climbs too, and the steps skipped
  until the controller cuts the LR are weights not damaged.
- A *recurring level*: a norm at a level that the last ``min_history`` steps *taken* rose to,
  at least half-way up from the median, and came back down from (below a quarter of the way)
  ``recurring`` (3) separate times or more. A multitask run whose second task comes every 5th
  step with a norm 5-7x the first task's had every one of those steps skipped, one at a time (so
  never ``max_consecutive`` in a row), and the second task stopped learning; its steps were
  taken before the guard armed, so their level is in the window. Steps the guard skipped never
  count: a gradient poisoned every 8th step, or a corrupted batch every 5th, is skipped every
  time (counted, the first 3 skips made the level "recurring" and a 50x gradient was trained
  from the 4th on: +10 % final loss with AdamW, a divergence with SGD). A second task added
  mid-run is such a level too: mark it (``Agent.run_changed``), and the guard starts its
  baseline afresh with it.

Skipped steps do not enter the window (the baseline stays that of the healthy steps). After
``max_consecutive`` skipped steps in a row the guard stops skipping and takes the step: a
persistent change (e.g. the user's own LR schedule jumped, or the data mixture changed) is not
something skipping can fix, and a guard that skips forever would stall the run silently. The
guard then starts its baseline afresh from the steps that follow (a new regime: nothing is skipped
for ``min_history`` steps), so a level shift costs ``max_consecutive`` skipped steps, not the
hundreds of steps it would take a robust median to move. Such a run shows in
``trainguard_consecutive_skipped_steps`` and the controller escalates (adaptive LR, rollback,
pause).

A spike on a step after the run froze or unfroze part of the model (the elements that require a
gradient changed since the baseline started), or after a change the user marked
(``Agent.run_changed``: a new loss weight), is taken and starts a new baseline, as after
``max_consecutive`` skips: a linear probe's head alone has a gradient norm tens of times smaller
than the whole model's, and skipping the first fine-tuning steps cannot change that.

A skipped spike whose gradient comes back the same on the next step (the same norm, within
``REPEAT_RTOL``) is taken at once and starts a new baseline, as after ``max_consecutive`` skips.
A skip leaves the weights as they were, so a batch that is the same (full-batch training, a loop
that repeats its batch) gives the same gradient again: the spike is the weights', not a batch's,
and skipping it again cannot change it. Full-batch Adam at a plateau (5-8x spikes from a
near-zero norm) had each spike skipped 16 times in a row, 224 of 3,000 steps; now 15, one per
spike. The new baseline holds the run's own spikes, so fewer of them count as spikes after it.
Different batches give norms that agree to 1e-6 only by chance.

Steps skipped for their data (the controller's data skip, a cause-``data`` incident) do not count
as skips here and leave the window as it was. The data skip reaches the ranks a few steps after the
first bad batch, so those batches may already have been trained. The model then sits elsewhere, and
good data gives larger gradients than the window's (after 3 batches of random bytes a small GPT's
loss went from 3.0 to 4.4, its gradient norm from 0.7 to 12-15). So the first step after a data
skip is judged against the window: when it is a spike, the guard takes it and starts its baseline
afresh from it, as after ``max_consecutive`` skips. Skipping good data cannot undo what the bad
batches did; training on good data does. The controller's rollback, when a snapshot from before the
onset exists, undoes them. The guard's state is the same on every rank as long as the ranks see the same global
gradient norms (data parallelism); the ranks agree on the decision anyway (the skip flag's
all-reduce, ``trainer_agent/control/actuators.py``).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Hashable
from statistics import median
from typing import Any

from trainer_agent.config import SpikeGuardConfig

__all__ = ["REPEAT_RTOL", "SpikeGuard", "SpikeGuardConfig"]

_MAD_TO_SIGMA = 1.4826

#: Relative difference within which a spike's gradient norm, right after the same spike was
#: skipped, is taken as the same gradient again (see the module). Deterministic kernels give it
#: exactly; nondeterministic ones (atomic adds) differ by rounding, ~1e-7 in float32.
REPEAT_RTOL = 1e-6


class SpikeGuard:
    """Rolling robust baseline of the gradient norms of the steps taken; pure host code."""

    def __init__(self, config: SpikeGuardConfig | None = None, *,
                 regime: Callable[[], Hashable] | None = None, lr_jumped: Callable[[], bool] | None = None) -> None:
        self.config = config or SpikeGuardConfig()
        #: Whether the LR the schedule asks for now jumped above every LR the run trained at or was
        #: built on (``ScheduledLr.above_envelope``): a climb is then not the run's. Read on a
        #: climbing norm above the threshold only.
        self.lr_jumped = lr_jumped
        #: What the run trains now and how: the elements that train (``ParamIndex.trainable_elements``)
        #: and the changes the user marked (``Agent.run_changed``). Read when a baseline starts and
        #: on a spike only.
        self.regime = regime
        self._regime_at_start: Hashable = None  # the regime when the baseline started
        self._norms: deque[float] = deque(maxlen=self.config.window)
        self.consecutive = 0
        """Steps skipped in a row (any reason), reset by a step taken."""
        self.restarts = 0
        """Baselines started afresh (after ``max_consecutive`` skips in a row, or after a data skip)."""
        self._after_data_skip = False  # the next step judged is the first after a data skip
        self._rebase = False  # the next step taken starts a new baseline
        self._last_spike: float | None = None  # the norm of the last step judged a spike, until one is taken

    def threshold(self) -> float:
        """The norm above which a step is a spike now (inf before ``min_history`` steps)."""
        cfg = self.config
        if len(self._norms) < cfg.min_history:
            return math.inf
        m = median(self._norms)
        mad = median(abs(x - m) for x in self._norms)
        return max(m + cfg.sigmas * _MAD_TO_SIGMA * mad, cfg.min_ratio * m)

    def is_spike(self, norm: float) -> bool:
        """True when the step with this (finite) global gradient norm should not be taken."""
        if self.consecutive >= self.config.max_consecutive:
            return False
        spike = norm > self.threshold() and not self._climb(norm) and not self._recurring(norm)
        if self._after_data_skip:
            self._after_data_skip = False
            if spike:  # the bad batches trained before the data skip moved the model: a new regime
                self._rebase = True
                return False
        if spike and self.consecutive and self._last_spike is not None and math.isclose(
                norm, self._last_spike, rel_tol=REPEAT_RTOL):
            self._rebase = True  # the same gradient again: skipping cannot change it (see the module)
            return False
        if spike and self._regime_changed():
            self._rebase = True  # part of the model frozen or unfrozen, a change marked: a new regime (see the module)
            return False
        if spike:
            self._last_spike = norm
        return spike

    def _climb(self, norm: float) -> bool:
        """Whether ``norm`` is at most ``min_jump`` times the largest of the last 3 norms taken."""
        recent = max(itertools.islice(reversed(self._norms), 3), default=0.0)
        return norm <= self.config.min_jump * recent and not (self.lr_jumped is not None and self.lr_jumped())

    def _recurring(self, norm: float) -> bool:
        """Whether the last ``min_history`` steps taken rose to ``norm``'s level (half-way up from
        the median) and came back down (below a quarter of the way: the median's own noise is no
        obstacle) ``recurring`` separate times or more."""
        if not self.config.recurring:
            return False
        base = median(self._norms)
        level, back = base + 0.5 * (norm - base), base + 0.25 * (norm - base)
        visits, high = 0, False
        for x in itertools.islice(self._norms, max(0, len(self._norms) - self.config.min_history), None):
            if not high and x >= level:
                high = True
            elif high and x <= back:
                high, visits = False, visits + 1
        return visits >= self.config.recurring

    def _regime_changed(self) -> bool:
        """Whether the regime (:attr:`regime`) changed since the baseline started."""
        if self.regime is None:
            return False
        now = self.regime()
        before, self._regime_at_start = self._regime_at_start, now
        return before is not None and now != before

    def data_skipped(self) -> None:
        """A step was skipped for its data: not a skip of this guard's, the window stays; the first
        step judged after the data skip may start a new baseline (see the module's docstring)."""
        self._after_data_skip = True

    def taken(self, norm: float) -> None:
        """The step was taken: its norm joins the baseline (a non-finite one does not). Taken
        after ``max_consecutive`` skips, as the first spike after a data skip, or as a skipped
        spike's gradient again, it starts a new baseline."""
        if self.consecutive >= self.config.max_consecutive or self._rebase:
            self._norms.clear()
            self.restarts += 1
            self._rebase = False
        self.consecutive, self._last_spike = 0, None
        if math.isfinite(norm):
            if not self._norms and self.regime is not None:
                self._regime_at_start = self.regime()  # a baseline starts: under this regime
            self._norms.append(norm)

    def skipped(self) -> None:
        self.consecutive += 1

    def state_dict(self) -> dict[str, Any]:
        return {"norms": list(self._norms), "consecutive": self.consecutive, "after_data_skip": self._after_data_skip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            norms = [float(x) for x in state["norms"]]
            consecutive = int(state["consecutive"])
            after_data_skip = state.get("after_data_skip", False)  # (absent from older snapshots)
            if not isinstance(after_data_skip, bool):
                raise TypeError(f"after_data_skip must be a bool, got {after_data_skip!r}")
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed spike guard state: {exc!r}") from None
        self._norms = deque(norms[-self.config.window:], maxlen=self.config.window)
        self.consecutive = max(consecutive, 0)
        self._after_data_skip, self._rebase = after_data_skip, False
