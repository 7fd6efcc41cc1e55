"""The training driver's parts: plan, data, loop, evaluation, checkpoints, run files."""
