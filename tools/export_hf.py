#!/usr/bin/env python
"""Export a training checkpoint as a Hugging Face model folder (``--help`` says how); the program is
sparse_rl_mega/cli/export_hf.py (also installed as ``sparse-rl-export-hf``), its writer
sparse_rl_mega/learner/export.py."""
import sys

import _bootstrap  # noqa: F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
from sparse_rl_mega.cli.export_hf import main

if __name__ == "__main__":
    sys.exit(main())
