"""The private member of DDP the agent reads: the communication hooks registered on a
``DistributedDataParallel`` (``register_comm_hook`` keeps them in ``_comm_hooks``; torch has no
public getter), so that post-local SGD's hook is recognised
(``trainer_agent/measure/fingerprint_layouts.py``). The other private torch members are in
``trainer_agent/compat/torch_private.py`` and ``trainer_agent/compat/torch_hooks.py``. The
member's test is in ``tests/agent/test_torch_ddp.py``."""

from __future__ import annotations

from typing import Any

from trainer_agent.compat import PrivateMember, degraded

__all__ = ["comm_hook_states"]

#: The releases the member below was checked against (tests/agent/test_torch_ddp.py passed on them).
CHECKED_VERSIONS = {"torch": "2.13.0"}

PRIVATE_MEMBERS = (
    PrivateMember("torch.nn.parallel.DistributedDataParallel._comm_hooks", "_comm_hooks", "comm_hook_states",
                  "test_comm_hook_states_are_the_registered_hooks_states"),
)


def comm_hook_states(ddp: Any) -> list[Any]:
    """The states of the communication hooks registered on ``ddp`` (in order). Where the member is
    gone: none (logged once: post-local SGD through DDP's hook is then not recognised, and its
    ranks' fingerprints are compared; pass ``PostLocalSGDOptimizer`` to attach, or set
    ``AgentConfig(fingerprint=False)``)."""
    hooks = getattr(ddp, "_comm_hooks", None)
    if not isinstance(hooks, list) or not all(isinstance(h, tuple) and len(h) == 2 for h in hooks):
        degraded("DistributedDataParallel._comm_hooks", "DDP's post-local SGD hook is not recognised: its ranks' "
                 "fingerprints are compared (set AgentConfig(fingerprint=False))")
        return []
    return [state for _, state in hooks]
