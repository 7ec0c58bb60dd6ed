"""What is on disk: a run's checkpoints (saved, verified, resumed from), the results folder, and the one
atomic writer every file goes through (files.py)."""
