"""The launcher (``tools/launch.py``, ``sparse-rl-launch``): a Sparse-RL run from a YAML config.

  torchrun --nproc-per-node N tools/launch.py CONFIG      train (N = parallel.nproc_per_node)
  python tools/launch.py CONFIG [--max-restarts N]       single node: runs torchrun's agent itself
  python tools/launch.py CONFIG --dry-run                validate and print the parallel layout
  python tools/launch.py CONFIG --plan [--gpu-memory-gb 80] [--prompt-tokens 512]
                                                         validate, print the layout and per-GPU memory

The config and the inputs it names are checked before any process starts (sparse_rl_mega/cli/preflight.py:
data rows, the model folder, prompt + max_new_tokens against what SGLang generates, torchrun's process
count); a problem is reported naming the key (file, rows) and what was expected, with exit status 2.
--dry-run checks the inputs present on this machine and lists the others. --plan starts
nothing either (no process, no GPU): it prints the learner's and the engine's memory per GPU
(sparse_rl_mega/cli/planner.py) and exits 0 when everything fits, 3 when something does not.

A failed job prints one line per failed rank (tracebacks: <run_dir>/logs/rank<R>.log) and one from
the launcher (exit status 1); with --max-restarts N the launcher starts it again from its newest
complete checkpoint, up to N times. A stopped job (Ctrl-C, SIGTERM) names the checkpoint --resume
would continue from, or says that there is none. A crashed or hung rollout engine is restarted inside the job
(rollout.engine_timeout_s, rollout.max_engine_restarts). Every process of the job ends when the
launcher ends, however it ends; the run folder is locked while the job runs (docs/reliability.md).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from sparse_rl_mega.cli.describe import describe_layout, resume_hint
from sparse_rl_mega.cli.preflight import preflight
from sparse_rl_mega.config import RunConfig, load_config_or_exit  # (no torch: main() sets OMP_NUM_THREADS first)
from sparse_rl_mega.cli.planner import format_plan, plan_memory
from sparse_rl_mega.runtime import warm_fork, watchdog
from sparse_rl_mega.runtime.faults import LAUNCHER_PID_ENV
from sparse_rl_mega.runtime.jobs import (FolderLocked, LOCK_HELD_ENV, STOP_WITH_PARENT_ENV, clear_earlier_run,
                                         earlier_run, earlier_run_problem, end_torchrun_agent, held_by_launcher,
                                         lock_job_folders)
from sparse_rl_mega.runtime.quiet import quiet_known_warnings
from sparse_rl_mega.train.forked_ranks import run_on_this_node, start_job_rank_server
from sparse_rl_mega.train.tracking import end_left_running
from sparse_rl_mega.runtime.paths import ROOT

LAUNCHED_AT_ENV = "SPARSE_RL_MEGA_LAUNCHED_AT"  # the launch's start, from this process to its torchrun workers
LAUNCH_SCRIPT = ROOT / "tools" / "launch.py"  # what torchrun runs on every rank
warm_fork.read_after_start(LAUNCHED_AT_ENV)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="launch.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML run config, e.g. examples/cpu_tiny.yaml")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config, print the layout and exit without starting anything")
    parser.add_argument("--plan", action="store_true",
                        help="validate, print the layout and a per-GPU memory plan of learner and engines, exit "
                             "(0: fits, 3: something does not fit); starts nothing")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, metavar="GIB",
                        help="--plan: memory of one GPU in GiB (2**30 bytes; default 80)")
    parser.add_argument("--prompt-tokens", type=int, default=512, metavar="N",
                        help="--plan: prompt length assumed for activations and KV needs (default 512)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value by dotted path (repeatable), e.g. --set trainer.iterations=5")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint under checkpoint.dir (same as "
                             "--set checkpoint.resume=auto); a different TP/PP layout may load it")
    parser.add_argument("--overwrite", action="store_true",
                        help="start anew in a run folder that holds an earlier run: remove its checkpoints and "
                             "per-iteration records first (its MLflow store keeps its runs); without it, or "
                             "--resume, such a launch stops (single node: python tools/launch.py)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="start a failed job again from its newest complete checkpoint, up to N times "
                             "(single node; on a cluster use torchrun's --max-restarts with "
                             "--set checkpoint.resume=auto)")
    args = parser.parse_args(argv)
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    if args.gpu_memory_gb <= 0 or args.prompt_tokens < 1:
        parser.error("--gpu-memory-gb must be > 0 and --prompt-tokens >= 1")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in the folder, --overwrite removes it: give one of them")
    if args.resume:
        args.overrides.append("checkpoint.resume=auto")
    return args


def run_job(cfg: RunConfig, args: argparse.Namespace, launched_at: float) -> int:
    """Single node: torchrun's agent in this process (one line when the job fails, instead of its
    report), restarted from the newest checkpoint up to ``--max-restarts`` times; its ranks run
    ``tools/launch.py``. ``launched_at``: the launch's start (``time.time()``), start-up is counted from."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        locks = lock_job_folders(cfg)
    except FolderLocked as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    held = earlier_run(cfg) if cfg.checkpoint.resume is None else None
    if held and not args.overwrite:
        for lock in locks:
            lock.release()
        return report_problems(args.config, [earlier_run_problem(cfg, held)])
    if held:
        print(f"[launch] --overwrite: removed {clear_earlier_run(cfg)}", flush=True)
    import torch.distributed.elastic.agent.server.api as agent_api

    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)  # the agent's own report: see below
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # ("Terminating process N": idem)
    # (its agent's logger has a level of its own; "Received 15 death signal": the stop line below says it)
    agent_api.logger.setLevel(logging.ERROR)
    os.environ.update({LAUNCHED_AT_ENV: repr(launched_at), LOCK_HELD_ENV: "1", LAUNCHER_PID_ENV: str(os.getpid())})
    overrides = list(args.overrides)
    print(describe_layout(cfg), flush=True)
    forked = start_job_rank_server(cfg)  # CPU: ranks forked from here, modules imported once (forked_ranks.py)
    try:
        for attempt in range(args.max_restarts + 1):
            if attempt:  # a restart's start-up is counted from its own start
                os.environ[LAUNCHED_AT_ENV] = repr(time.time())
            attempt_started = time.time()
            try:
                run_on_this_node(cfg.parallel.nproc_per_node, str(LAUNCH_SCRIPT),
                                 [args.config] + [f"--set={item}" for item in overrides], forked)
                return 0
            except ChildFailedError as exc:
                rank, failure = exc.get_first_failure()
                how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
                       else f"exited with status {failure.exitcode}")
                what = f"the job failed: rank {rank} {how}"
                if any(f.exitcode == watchdog.EXIT_STATUS for f in exc.failures.values()) or \
                        watchdog.fired_since(cfg.trainer.run_dir, attempt_started):
                    what = "the job was stopped by its watchdog (the [watchdog] line above names the rank)"
                left = args.max_restarts - attempt
                then = (f"; starting it again from the newest checkpoint ({left} restart(s) left)" if left
                        else "; no restarts left (--max-restarts)" if args.max_restarts else "")
                print(f"[launch] {what}{then}", file=sys.stderr, flush=True)
                if not left:
                    end_mlflow_run(cfg, "FAILED")
                    return 1
                overrides.append("checkpoint.resume=auto")
        return 1
    except (SignalException, KeyboardInterrupt) as exc:  # the agent has stopped the workers
        name = exc.sigval.name if isinstance(exc, SignalException) else "SIGINT"
        print(f"[launch] stopped by {name}; {resume_hint(cfg)}", file=sys.stderr, flush=True)
        end_mlflow_run(cfg, "KILLED")
        return 128 + (exc.sigval if isinstance(exc, SignalException) else 2)
    finally:
        # the ranks have ended: what their killed engines left in /dev/shm goes now (rollout/shm_record.py)
        from sparse_rl_mega.rollout.shm_record import sweep_and_say

        sweep_and_say(cfg.trainer.run_dir, "[launch]", "this job",
                      lambda line: print(line, file=sys.stderr, flush=True), wait_s=5.0)
        for lock in locks:
            lock.release()


def end_mlflow_run(cfg, status: str) -> None:
    """The ranks are stopped: end the MLflow run they logged to if rank 0 could not (it was killed)."""
    if cfg.tracking.enabled:

        line = end_left_running(cfg.trainer.run_dir, status)
        if line:
            print(line, file=sys.stderr, flush=True)


def report_problems(config: str, problems: list[str]) -> int:
    """One ``config error:`` line per problem (under torchrun from each node's first process); exit status 2."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        for line in problems:
            print(f"config error: {config}: {line}", file=sys.stderr)
    return 2


def main(argv=None, launched_at: float | None = None) -> int:
    """The launcher; ``launched_at``: when its process started (``time.time()``; default now), the
    start of what the run reports as start-up."""
    launched_at = time.time() if launched_at is None else launched_at

    quiet_known_warnings()  # dependencies' CPU-only notices, named in sparse_rl_mega/runtime/quiet.py
    under_torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not under_torchrun:  # what torchrun sets for its workers (its notice about it is silenced); set
        # before torch is imported here: its OpenMP pool would otherwise start threads in this process,
        # which forks the ranks' server (sparse_rl_mega/train/forked_ranks.py)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if under_torchrun:
        warm_fork.die_with_parent()  # no learner rank outlives its launcher or torchrun agent
    elif os.environ.pop(STOP_WITH_PARENT_ENV, None):  # started by a tool (launches.py): stop when it ends
        warm_fork.die_with_parent(signal.SIGTERM)
    args = parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides)
    if args.dry_run:
        checked = preflight(cfg, dry_run=True)
        if checked.problems:
            return report_problems(args.config, checked.problems)
        print(describe_layout(cfg))
        print("config OK (dry run: nothing started)")
        for line in checked.not_here:
            print(f"  not on this machine, not checked: {line}")
        for line in checked.warnings:
            print(f"[warn] {line}")
        return 0
    if args.plan:

        plan = plan_memory(cfg, args.gpu_memory_gb, args.prompt_tokens)
        print(describe_layout(cfg))
        print(format_plan(cfg, plan))
        return 0 if plan.fits else 3

    checked = None if held_by_launcher() else preflight(cfg)  # (a launcher checked them already)
    problems = checked.problems if checked is not None else []
    if checked is not None and not problems and os.environ.get("LOCAL_RANK", "0") == "0":
        for line in checked.warnings:
            print(f"[warn] {line}", flush=True)
    if under_torchrun and not held_by_launcher():
        if args.overwrite:  # a restart by torchrun would remove the job's own checkpoints
            problems.append("--overwrite: not under torchrun (its restarts would remove this job's own "
                            "checkpoints); remove the earlier run's checkpoints yourself or choose a new trainer.run_dir")
        elif cfg.checkpoint.resume is None and (held := earlier_run(cfg)):
            problems.append(earlier_run_problem(cfg, held))
    if problems:
        status = report_problems(args.config, problems)
        if under_torchrun:

            end_torchrun_agent(int(os.environ["LOCAL_RANK"]))
        return status
    if not under_torchrun:
        if cfg.parallel.nnodes > 1:
            print("config error: parallel.nnodes > 1: start this script with torchrun on every node "
                  "(see docs/cluster.md)", file=sys.stderr)
            return 2
        return run_job(cfg, args, launched_at)
    from sparse_rl_mega.train.entry import run_training

    run_training(cfg, float(os.environ.get(LAUNCHED_AT_ENV, launched_at)))
    return 0

