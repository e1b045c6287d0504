"""trainguard's in-process training agent.

    import trainer_agent as ta
    agent = ta.attach(model, optimizer, job="llm-7b", run="llm-7b-0001")

Attributes are imported lazily (PEP 562) so that torch-free modules of this package
(``trainguard.protocol.catalog``) can be imported by the controller and the dashboards without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainer_agent.version import __version__

_LAZY = {
    "attach": "trainer_agent.agent",
    "Agent": "trainer_agent.agent",
    "AgentConfig": "trainer_agent.config",
    "DcpSnapshots": "trainer_agent.control.dcp_snapshots",
    "DataMonitor": "trainer_agent.data",
    "QualityFilter": "trainer_agent.data",
    "dynamic_threshold": "trainer_agent.data",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    from trainer_agent.agent import Agent, attach
    from trainer_agent.config import AgentConfig
    from trainer_agent.control.dcp_snapshots import DcpSnapshots
    from trainer_agent.data import DataMonitor, QualityFilter, dynamic_threshold


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
