"""Kill parts of a training job at random points and check that it ends exactly where an uninterrupted
run ends.

    python tools/chaos.py examples/cpu_tiny.yaml --trials 10 [--seed 0] [--set KEY=VALUE ...]

The config runs once uninterrupted, then ``--trials`` times with one fault drawn at random (seeded):
SIGKILL of engine 0's scheduler, SIGSTOP of it (a hang), SIGKILL of one learner rank or of the launcher,
SIGSTOP of one learner rank (from iteration 2 on: the learner's watchdog must find it and stop the job,
``trainer.watchdog_floor_s=10`` in such a trial),
during the rollout, the training, the weight push or the checkpoint save of a random iteration
(``sparse_rl_mega/runtime/faults.py`` fires it inside the job at that point); a full disk while a checkpoint
is written (the writer's ENOSPC: the job stops with one line, the launcher restarts it); a corrupt
newest checkpoint (a shard cut in half, then rank 0 killed: the restart must skip it and resume from
the one before); the MLflow tracking server killed (the trial logs to a real ``mlflow server`` that
this tool starts, and starts again ``TRACKING_DOWN_S`` after it dies: no metric may be missing). The job recovers by itself
(engine restart, or the launcher's ``--max-restarts``); a killed launcher takes its whole job with it
(nothing may be left running), and the tool then starts it again with ``--resume``, as a person or a
cluster scheduler would. No process of a trial's job may be left 15 s after it ended (found by an
environment variable that every process of the job inherits). Each trial's final checkpoint (weights,
optimizer state) and its per-iteration metrics (MLflow; the last value logged per iteration) must
equal the uninterrupted run's. Not compared:
``time/*``, ``engine/restarts`` and ``sync/pre_sync_*`` (the engine before a push: a restarted engine
holds the initial weights there).

Prints one line per trial and ``exact=K/N``; exit status 0 when every trial is exact. Runs go to
``--out`` (default ``runs/chaos/<time>``), each trial's output to ``trialNN.log`` beside its folder.
Checkpoints are saved every iteration (a killed learner resumes from the newest).

``--fault SPEC`` replays chosen faults instead of drawing them (one trial per ``--fault``; a SPEC is
what a trial line prints, several faults joined by commas, e.g. ``kill-rank0@train:3+0.1``), and
``--reference RUN_DIR`` compares with an uninterrupted run made before (same config and overrides,
checkpoints every iteration) instead of launching one.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from sparse_rl_mega.config import load_config_or_exit
from sparse_rl_mega.runtime.faults import FAULT_ENV, TRACKING_SERVER_PID_ENV, Fault, parse_faults
from sparse_rl_mega.train.run_records import compare, final_state, metrics_by_iteration
from sparse_rl_mega.runtime.ports import free_port
from sparse_rl_mega.runtime.quiet import quiet_known_warnings
from sparse_rl_mega.runtime.paths import ROOT


TARGETS = ["kill-engine", "stop-engine", "kill-rank0", "kill-rank1", "stop-rank0", "stop-rank1", "kill-launcher",
           "full-disk", "corrupt-checkpoint", "kill-tracking"]
PHASES = ["rollout", "train", "push", "checkpoint"]
HANG_TIMEOUT_S = 10  # rollout.engine_timeout_s in the trials: a stopped engine is found within this
WATCHDOG_FLOOR_S = 10  # trainer.watchdog_floor_s in the trials: a stopped learner rank is found within about this


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="chaos.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML run config (e.g. examples/cpu_tiny.yaml)")
    p.add_argument("--trials", type=int, default=10, help="faulted runs (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the faults drawn (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: runs/chaos/<time>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run (repeatable)")
    p.add_argument("--fault", dest="faults", action="append", default=[], metavar="SPEC",
                   help="one trial with these faults instead of drawn ones (repeatable), e.g. kill-engine@push:2+0.1")
    p.add_argument("--reference", type=Path, default=None, metavar="RUN_DIR",
                   help="an uninterrupted run of the same config to compare with (not launched again)")
    args = p.parse_args(argv)
    if args.trials < 1:
        p.error("--trials must be >= 1")
    try:
        args.faults = [parse_faults(spec) for spec in args.faults]
    except ValueError as error:
        p.error(f"--fault: {error}")
    if args.reference is not None and not (args.reference / "mlflow.db").is_file():
        p.error(f"--reference {args.reference}: no run folder there (no mlflow.db)")
    return args


def draw_faults(n: int, iterations: int, world: int, seed: int) -> list[Fault]:
    """``n`` faults, targets taken in turn from a shuffled cycle (so that few trials still cover every
    kind), phase, iteration and delay at random."""
    rng = random.Random(seed)
    targets = [t for t in TARGETS if not t.startswith(("kill-rank", "stop-rank")) or int(t.rsplit("rank", 1)[1]) < world]
    order: list[str] = []
    while len(order) < n:
        cycle = targets[:]
        rng.shuffle(cycle)
        order += cycle
    return [_fault(what, iterations, rng) for what in order[:n]]


def _fault(what: str, iterations: int, rng: random.Random) -> Fault:
    """A fault at a random point; a full disk when a checkpoint is written; a corrupt checkpoint from
    iteration 3 on (the newest is cut, the one before it must exist to resume from); a stopped learner
    rank from iteration 2 on (in iteration 1 every phase is a first one, whose bound is
    trainer.watchdog_first_s: 35 min)."""
    if what == "full-disk":
        return Fault(what, "checkpoint", rng.randint(1, iterations))
    if what == "corrupt-checkpoint":
        return Fault(what, rng.choice(PHASES), rng.randint(min(3, iterations), iterations))
    earliest = 2 if what.startswith("stop-rank") else 1
    return Fault(what, rng.choice(PHASES), rng.randint(min(earliest, iterations), iterations),
                 round(rng.uniform(0.0, 0.5), 2))


def launch(config: str, run_dir: Path, overrides: list[str], env: dict, extra: list[str]) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "tools" / "launch.py"), config, f"--set=trainer.run_dir={run_dir}",
               *[f"--set={o}" for o in overrides], *extra]
    with open(run_dir.parent / f"{run_dir.name}.log", "a") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        return subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


TRIAL_ENV = "SPARSE_RL_MEGA_CHAOS_RUN"  # marks every process a trial's job starts (inherited by all)
TRACKING_DOWN_S = 5.0  # how long a killed tracking server stays down before it is started again


class TrackingServer:
    """A real ``mlflow server`` on a free loopback port whose store is the trial's ``<run_dir>/mlflow.db``
    (where the metrics are compared from), started again ``TRACKING_DOWN_S`` after it dies, until
    :meth:`stop`."""

    def __init__(self, run_dir: Path, log: Path, start_timeout_s: float = 180.0):

        self.run_dir, self.log, self.start_timeout_s = run_dir, log, start_timeout_s
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.stopping = threading.Event()
        self.restarts = 0
        self.process = self._start()
        self.keeper = threading.Thread(target=self._keep_up, daemon=True, name="tracking-server")
        self.keeper.start()

    def _start(self) -> subprocess.Popen:
        import urllib.request

        env = {k: v for k, v in os.environ.items() if k not in (TRIAL_ENV, FAULT_ENV)}
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # (no job-runner processes: not used here)
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--backend-store-uri", f"sqlite:///{self.run_dir / 'mlflow.db'}",
                   "--artifacts-destination", str(self.run_dir / "mlartifacts")]
        with open(self.log, "a") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + self.start_timeout_s
        while time.time() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return process
            except OSError:
                time.sleep(0.5)
        self._kill(process)
        raise RuntimeError(f"mlflow server on port {self.port} did not answer /health within "
                           f"{self.start_timeout_s:.0f} s (log: {self.log})")

    def _keep_up(self) -> None:
        while not self.stopping.is_set():
            if self.process.poll() is not None:  # killed by the fault: down a while, then up again
                if self.stopping.wait(TRACKING_DOWN_S):
                    return
                self.process = self._start()
                self.restarts += 1
            self.stopping.wait(0.5)

    @staticmethod
    def _kill(process: subprocess.Popen) -> None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=10)

    def stop(self) -> None:
        self.stopping.set()
        self.keeper.join(timeout=self.start_timeout_s + 10)
        self._kill(self.process)


def processes_of(run_dir: Path) -> list[int]:
    """Pids of live processes started for the trial writing ``run_dir``, found by the variable
    :data:`TRIAL_ENV` that every process of its job inherits (orphans included)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(TRIAL_ENV) == str(run_dir) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(found)


def left_behind(run_dir: Path, wait_s: float = 15.0) -> list[int]:
    """Processes of the trial still alive ``wait_s`` after its job ended (they are killed then)."""
    deadline = time.time() + wait_s
    while (leftovers := processes_of(run_dir)) and time.time() < deadline:
        time.sleep(0.5)
    for pid in leftovers:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    return leftovers


def main(argv=None) -> int:

    quiet_known_warnings()
    args = parse_args(argv)
    cfg = load_config_or_exit(args.config, args.overrides)
    out = (args.out or ROOT / "runs" / "chaos" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    iterations = cfg.trainer.iterations
    overrides = list(args.overrides) + ["checkpoint.save_interval=1", "checkpoint.dir=null"]
    base_env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}

    started = time.time()
    reference_dir = args.reference
    if reference_dir is None:
        reference_dir = out / "uninterrupted"
        done = launch(args.config, reference_dir, overrides, base_env, [])
        if done.returncode != 0:
            print(f"[chaos] the uninterrupted run failed (status {done.returncode}); see {reference_dir}.log",
                  file=sys.stderr)
            return 1
    reference = (final_state(reference_dir, iterations), metrics_by_iteration(reference_dir))
    how_made = f"in {time.time() - started:.0f} s" if args.reference is None else "given"
    print(f"[chaos] uninterrupted run: {iterations} iterations {how_made} ({reference_dir})", flush=True)

    trials = args.faults or [[f] for f in draw_faults(args.trials, iterations, cfg.world_size, args.seed)]
    exact = 0
    for n, faults in enumerate(trials, 1):
        run_dir = out / f"trial{n:02d}"
        spec = ",".join(f.spec() for f in faults)
        kinds = {f.what for f in faults}
        env = {**base_env, FAULT_ENV: spec, TRIAL_ENV: str(run_dir)}
        trial_overrides = overrides + ([f"rollout.engine_timeout_s={HANG_TIMEOUT_S}"] if "stop-engine" in kinds else []) \
            + ([f"trainer.watchdog_floor_s={WATCHDOG_FLOOR_S}"] if any(k.startswith("stop-rank") for k in kinds) else [])
        started = time.time()
        server = None
        if "kill-tracking" in kinds:  # the run logs to a real server that the fault kills and this tool restarts
            run_dir.mkdir(parents=True, exist_ok=True)
            server = TrackingServer(run_dir, run_dir.parent / f"{run_dir.name}.mlflow.log")
            env[TRACKING_SERVER_PID_ENV] = str(server.process.pid)
            trial_overrides = trial_overrides + [f"tracking.tracking_uri={server.uri}"]
        try:
            done = launch(args.config, run_dir, trial_overrides, env, ["--max-restarts", "2"])
            how = "recovered in the job"
            leftovers = left_behind(run_dir)  # whatever the fault, nothing of the job may outlive it
            if done.returncode != 0 and "kill-launcher" in kinds:
                done = launch(args.config, run_dir, trial_overrides, env, ["--resume"])
                how = "launcher killed; started again with --resume"
                leftovers += left_behind(run_dir)
        finally:
            if server is not None:
                server.stop()
        text = (run_dir.parent / f"{run_dir.name}.log").read_text()
        if "starting it again from the newest checkpoint" in text:
            how = "job restarted by the launcher"
            if "[watchdog] " in text:
                how = "stopped by the watchdog; " + how
            if "not saved: " in text:
                how = "checkpoint not saved; " + how
            if "skipped: it does not verify" in text:
                how = "corrupt checkpoint skipped; " + how
        elif "[engine] " in text and "restarting" in text:
            how = "engine restarted"
        elif server is not None:
            how = f"tracking server killed, up again after {server.restarts} restart(s)"
        if not all((run_dir / f".fault_{f.spec()}").exists() for f in faults):
            how += " (a fault did not fire)"
        diffs = [f"job failed (status {done.returncode})"] if done.returncode != 0 else \
            compare(reference, (final_state(run_dir, iterations), metrics_by_iteration(run_dir)))
        if leftovers:
            diffs.append(f"processes left after the job ended: {leftovers}")
        exact += not diffs
        verdict = "exact" if not diffs else "DIFFERS: " + "; ".join(diffs[:3]) + (f" (+{len(diffs) - 3})" if len(diffs) > 3 else "")
        print(f"[chaos] trial {n}/{len(trials)} {spec:<28} {how}, {time.time() - started:.0f} s: {verdict}", flush=True)
    print(f"[chaos] exact={exact}/{len(trials)} (runs and logs in {out})", flush=True)
    return 0 if exact == len(trials) else 1

