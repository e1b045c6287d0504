"""The agent's version (what a run registers with the controller)."""

__version__ = "0.1.0"
