"""The old name of :mod:`service.startup` (the controller's state read back from the database at
start-up; the recovery from incidents lives in :mod:`service.incidents`): re-exports it."""

from trainguard.service.startup import load_rules_state, load_run, stored_desired

__all__ = ["load_rules_state", "load_run", "stored_desired"]
