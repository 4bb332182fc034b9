#!/usr/bin/env python
"""Kill parts of a training job at random points and check that it ends exactly where an uninterrupted
run ends (``--help`` says how); the program is sparse_rl_mega/studies/chaos.py (also installed as
``sparse-rl-chaos``)."""
import sys

import _bootstrap  # noqa: F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
from sparse_rl_mega.studies.chaos import main

if __name__ == "__main__":
    sys.exit(main())
