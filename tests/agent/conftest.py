"""Fixtures of the agent's tests."""

from __future__ import annotations

import pytest

from trainer_agent.compat import DEGRADED


@pytest.fixture
def no_adapter_fallback():
    """Fails the test when an adapter of ``trainer_agent/compat/`` fell back (its private member
    was not found): the adapters' tests exercise the real members."""
    before = dict(DEGRADED)
    yield
    assert DEGRADED == before, f"an adapter fell back: {DEGRADED}"
