#!/usr/bin/env python
"""Accuracy of a model under dense and under sparse (KV-compressed) inference (``--help`` says how); the
program is sparse_rl_mega/cli/evaluate.py (also installed as ``sparse-rl-evaluate``)."""
import sys

import _bootstrap  # noqa: F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
from sparse_rl_mega.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
