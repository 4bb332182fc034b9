#!/usr/bin/env python
"""Launch a Sparse-RL run from a YAML config: ``python tools/launch.py CONFIG`` (single node) or
``torchrun --nproc-per-node N tools/launch.py CONFIG`` (every node); ``--help`` says more. The launcher
is sparse_rl_mega/cli/launch.py (also installed as ``sparse-rl-launch``)."""
import time

LAUNCHED_AT = time.time()  # start-up is counted from here (before the imports)

import sys  # noqa: E402

import _bootstrap  # noqa: E402, F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
from sparse_rl_mega.cli import launch  # noqa: E402


def main(argv=None) -> int:
    return launch.main(argv, launched_at=LAUNCHED_AT)


if __name__ == "__main__":
    sys.exit(main())
