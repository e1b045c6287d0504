"""What the agent measures on each rank: step statistics, norms and update sizes, fingerprints and sketches, timings, GPU health."""
