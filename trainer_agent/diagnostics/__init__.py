"""Checks run on demand: the pre-flight, the gradient recompute check, the memory trace, the process environment."""
