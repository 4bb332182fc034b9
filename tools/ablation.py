#!/usr/bin/env python
"""Train the same config under several rollout/correction variants and compare them side by side
(``--help`` says how); the program is sparse_rl_mega/studies/ablation.py (also installed as
``sparse-rl-ablation``)."""
import sys

import _bootstrap  # noqa: F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
from sparse_rl_mega.studies.ablation import main

if __name__ == "__main__":
    sys.exit(main())
