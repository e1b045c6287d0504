"""The actuators' set (``trainer_agent/control/actuator_set.py``) in one process: how a start and a
late registration judge the requests of the desired state."""

from __future__ import annotations

import torch

from trainguard.protocol.wire import DesiredState
from trainer_agent.control.actuator_set import ActuatorSet
from trainer_agent.control.actuators import ActuatorEnv


def test_a_late_judgment_takes_the_requests_made_after_the_registration() -> None:
    """The sequence numbers judged are the registration's: a newer one in the agreed state acts."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    checkpoints: list[int] = []
    env = ActuatorEnv(optimizer=opt, leader=True, on_error=lambda kind, exc: None, on_checkpoint=checkpoints.append)
    acts = ActuatorSet(env, opt, lambda: env.on_error)
    acts.start(DesiredState(), None)  # the start without a registration
    rolled: list[int] = []
    acts.rollback.act = lambda new, step: rolled.append(step)  # type: ignore[method-assign]
    zero = {f: 0 for f in acts.seq_fields}
    # registered with rollback 1 (applied by the process that ended) and checkpoint 2 (applied by none) ...
    acts.judge({**zero, "rollback_seq": 1, "checkpoint_seq": 2}, {**zero, "rollback_seq": 1, "checkpoint_seq": 1})
    # ... and the state agreed carries a rollback made after the registration
    state = DesiredState(generation=7, rollback_seq=2, checkpoint_seq=2)
    acts.apply(state, DesiredState(), 30)
    acts.serve_due(state, 30)
    acts.serve_due(state, 31)
    assert (rolled, checkpoints) == ([30], [30])
