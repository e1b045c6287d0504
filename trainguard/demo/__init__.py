"""The demo: a controller and a 2-rank training run with injected faults (``trainguard demo``),
and a webhook sink that verifies signatures. Not part of the library a training script imports."""
