#!/usr/bin/env python
"""The GPU check (``--help`` says what it checks): ``--prepare`` / ``--dry-run`` here, ``bash
tools/gpu_check.sh`` on the lent GPU machine. The program is sparse_rl_mega/cli/gpu_check.py (the standard
library and runtime/paths.py only: it starts before anything is installed there)."""
import sys

import _bootstrap  # noqa: F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
from sparse_rl_mega.cli.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
