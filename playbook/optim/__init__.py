"""The optimizer (optimizer.py: AdamW as --optimizer names it, how it rounds each new bf16 weight, stepped in
backward or after it) and the learning-rate schedule (schedule.py)."""
