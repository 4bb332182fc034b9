#!/usr/bin/env python
"""Write math training / evaluation sets as prompt_label jsonl (``--help`` lists them); the program is
sparse_rl_mega/cli/prepare_data.py, the sets sparse_rl_mega/data/sources/."""
import sys

import _bootstrap  # noqa: F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
from sparse_rl_mega.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
