"""The training loop run by every torchrun rank (``trainer.py``: set-up, then each iteration as its
phases), its cadence, step metrics, console, tracking, the held-out evaluation, the forked ranks."""
