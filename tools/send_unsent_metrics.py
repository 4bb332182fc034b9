#!/usr/bin/env python
"""Send the metrics that a job could not send to its MLflow tracking store (it was down when the job
ended) from RUN_DIR/mlflow_unsent.jsonl, in the order they were logged, with their own steps and times.

examples:
  python tools/send_unsent_metrics.py runs/cpu_tiny                     # the sqlite store in the run folder
  python tools/send_unsent_metrics.py runs/big --tracking-uri http://mlflow:5000

The job's last line names this command when it left such a file. The next launch in the same run
folder sends the file by itself before its own metrics; this tool is for a run folder that will not be
launched again. A store that still does not answer keeps the file (what was sent is removed from it,
so that trying again sends no value twice); exit status 1 then.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import _bootstrap  # noqa: E402, F401 (tools/_bootstrap.py: the package, or which Python runs the tools)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="send_unsent_metrics.py", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run folder (trainer.run_dir) that holds mlflow_unsent.jsonl")
    parser.add_argument("--tracking-uri", default=None,
                        help="the job's tracking.tracking_uri (default: the sqlite store in the run folder)")
    args = parser.parse_args(argv)
    from sparse_rl_mega.runtime.quiet import quiet_known_warnings
    from sparse_rl_mega.train.tracking import send_unsent

    quiet_known_warnings()
    try:
        print(send_unsent(args.run_dir.resolve(), args.tracking_uri))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
