"""What is on disk: a run's checkpoints (saved, verified, resumed from)."""
