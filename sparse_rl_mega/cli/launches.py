"""``python tools/launch.py CONFIG --set ...`` from the tools that start several launches of one config
(``tools/ablation.py``: a launch per variant; ``tools/bench_overlap.py``: one per staleness value and
repeat).

A launcher of a single-node CPU job imports torch, Megatron-Core and, when a rank hosts an engine, SGLang
before its warm server forks its ranks (``train/forked_ranks.py``): ~12 CPU-s of imports on these 2-core
machines, again for every launch. :func:`start_launch_server` makes the tool's own warm server
(``runtime/warm_fork.py``) import them once; :func:`run_launch` then runs each launch as a child of it,
which runs ``tools/launch.py`` as a script, as a new interpreter would, under the tool's environment of
that moment. Its ranks and engines start as they would under a new launcher (the launch makes a warm
server of its own). GPU machines and multi-node configs launch new interpreters as before, and so does
``tools/chaos.py``: it finds a trial's processes by a variable of their initial environment
(``/proc/PID/environ``), which a fork keeps from the process it was forked from.

Either way the launch stops as on SIGTERM (its job's processes, engines and folder locks with it) when
the tool ends, however it ends (``jobs.STOP_WITH_PARENT_ENV``): a tool stopped by a scheduler's SIGTERM
or SIGKILL leaves no launch training on.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from sparse_rl_mega.cli.launch import LAUNCH_SCRIPT
from sparse_rl_mega.config import ConfigError, load_config
from sparse_rl_mega.runtime.warm_fork import Descriptor, WarmProcess, run_script
from sparse_rl_mega.runtime.jobs import STOP_WITH_PARENT_ENV
from sparse_rl_mega.train.forked_ranks import start_job_rank_server



def start_launch_server(config: str, overrides: list[str]) -> bool:
    """Make this tool's warm server import what ``tools/launch.py`` imports for the job of ``config`` with
    ``overrides`` (``KEY=VALUE``), as a launcher makes its ranks' (``forked_ranks.start_job_rank_server``).
    False where the launches must be new interpreters; call it before anything that starts a thread here
    (MLflow's SQL store does). The tool sets ``OMP_NUM_THREADS`` (1 unless set) before it imports this
    module, which imports torch: torch's OpenMP pool must not start threads here."""
    try:
        cfg = load_config(config, overrides)
    except ConfigError:
        return False  # (the launch says what is wrong)
    return start_job_rank_server(cfg)


def run_launch(args: list[str], log: Optional[Path] = None, cwd: Optional[Path] = None, forked: bool = False) -> int:
    """``python tools/launch.py ARGS`` in ``cwd`` (default: this process's), its output to this process's
    or, with ``log``, to that file; a child of the warm server with ``forked`` (:func:`start_launch_server`),
    else a new interpreter. Its exit code (negative: the signal that ended it)."""
    environment = {**os.environ, STOP_WITH_PARENT_ENV: "1"}
    out = open(log, "w") if log else None
    try:
        if not forked:
            return subprocess.call([sys.executable, str(LAUNCH_SCRIPT), *args], cwd=cwd, stdout=out,
                                   stderr=subprocess.STDOUT if out else None, env=environment)
        stdio = None if out is None else (Descriptor(0), Descriptor(out.fileno()), Descriptor(out.fileno()))
        launch = WarmProcess(target=_run_launch_script, args=(list(args), str(cwd or os.getcwd())), stdio=stdio,
                             env=environment, name="launch")
        launch.start()
        launch.join()
        return launch.exitcode
    finally:
        if out:
            out.close()


def _run_launch_script(args: list[str], cwd: str) -> None:
    """(In the child) ``tools/launch.py`` run as ``__main__`` with ``args`` in ``cwd``."""
    os.chdir(cwd)
    run_script(str(LAUNCH_SCRIPT), args)
