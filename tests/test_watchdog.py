"""The learner's watchdog (sparse_rl_mega/runtime/watchdog.py) on a real c10d store (``HashStore``) and a
scripted clock: two ranks publish their records, both monitor. It must stay quiet through a long
phase that makes progress (an evaluation on rank 0 while rank 1 waits for it), through a long phase
seen for the first time (a first checkpoint), and stop the job once, naming the rank whose process
stopped running, as soon as no rank has made progress within the bound. (A stopped rank in a real
launch, found and restarted: tests/test_resume.py.)"""
import pytest
import torch.distributed as dist

from sparse_rl_mega.runtime.watchdog import EXIT_STATUS, Bounds, Watchdog

pytestmark = pytest.mark.unit


class Job:
    """Two ranks' watchdogs on one store and one clock; :meth:`run` advances the clock a second at a
    time and ticks the ranks that run."""

    def __init__(self, tmp_path, bounds=Bounds(floor_s=10.0, factor=5.0, first_s=600.0)):
        self.now = 0.0
        self.lines: list[str] = []
        self.stopped: list[int] = []
        store = dist.HashStore()
        self.ranks = [Watchdog(store, r, 2, bounds, str(tmp_path), clock=lambda: self.now,
                               report=self.lines.append, stop=self.stopped.append) for r in range(2)]
        self.running = {0, 1}
        for w in self.ranks:
            w.tick()

    def run(self, seconds: int, beating=()) -> None:
        for _ in range(seconds):
            self.now += 1.0
            for r in sorted(self.running):
                if r in beating:
                    self.ranks[r].beat()
                self.ranks[r].tick()

    def phase(self, name: str, seconds: int) -> None:
        """Both ranks go through ``name`` together."""
        for w in self.ranks:
            w.enter(name)
        self.run(seconds)
        for w in self.ranks:
            w.leave(name)


def test_quiet_while_any_rank_progresses_or_a_phase_runs_for_the_first_time(tmp_path):
    """...and shutting down, within its own bound, which then stops a job stuck there."""
    job = Job(tmp_path)
    job.phase("setup-load", 300)  # set-up: first time, within watchdog_first_s
    for iteration in range(3):
        for w in job.ranks:
            w.at_iteration(iteration)
        job.phase("rollout", 2)
        job.phase("train", 2)
    job.ranks[0].enter("eval")  # rank 0 evaluates for 20 minutes, answer after answer; rank 1 waits
    job.ranks[1].enter("rollout")
    job.run(1200, beating={0})
    job.ranks[0].leave("eval")
    job.ranks[1].leave("rollout")
    job.phase("checkpoint", 500)  # the first checkpoint: long, no beats, first time (bound 600 s)
    for w in job.ranks:
        w.enter("shutdown", bound_s=240.0)  # bounded by its waits' timeouts (the tracking store, the engines)
    job.run(230)
    assert job.lines == [] and job.stopped == []
    job.run(12)
    assert len(job.lines) == 1 and "(bound 240 s: the bound of shutdown, from the timeouts of its waits" in job.lines[0]


def test_a_stopped_rank_is_named_once_when_nothing_progresses_for_the_bound(tmp_path):
    job = Job(tmp_path)
    for iteration in range(3):
        for w in job.ranks:
            w.at_iteration(iteration)
        job.phase("rollout", 2)
        job.phase("train", 1)
    for w in job.ranks:
        w.at_iteration(3)  # (iterations 1-3 took 3 s each, between their phases)
    job.ranks[1].enter("checkpoint")  # a phase it never completed: its record's bound is watchdog_first_s
    job.ranks[1].tick()
    job.running.discard(1)  # SIGSTOP: rank 1 neither works nor publishes; its bound holds no one up
    job.run(15)  # bound: rank 0's, 5 x its longest iteration (3 s) = 15 s, more than the floor
    assert job.stopped == []
    job.run(2)
    assert job.stopped == [EXIT_STATUS] and len(job.lines) == 1, job.lines
    host, pid = job.ranks[1].host, job.ranks[1].pid
    assert job.lines[0] == (f"[watchdog] no rank has made progress for 16 s (bound 15 s: 5 x the longest iteration so far, "
                            f"3.0 s, rank 0): rank 1 (host {host}, pid {pid}) has not run for 16 s (its process is "
                            f"stopped or frozen), in phase checkpoint of iteration 4; stopping the job")
    assert (tmp_path / "logs" / "watchdog.log").read_text().endswith(job.lines[0] + "\n")
    job.running.add(1)  # the other monitor sees the same; the verdict is claimed once
    job.run(3)
    assert len(job.lines) == 1 and job.stopped == [EXIT_STATUS]


def test_ranks_that_run_but_are_stuck_blame_the_one_stuck_longest(tmp_path):
    job = Job(tmp_path, Bounds(floor_s=10.0, factor=5.0, first_s=600.0))
    job.phase("train", 1)
    job.ranks[1].enter("checkpoint")  # rank 1 goes on to a phase it has done before...
    job.ranks[1].leave("checkpoint")
    job.ranks[1].enter("checkpoint")
    job.run(3)
    job.ranks[0].enter("train")  # ...rank 0 entered its phase 3 s later and hangs there too
    job.run(12)
    assert len(job.lines) == 1 and "rank 1 (host" in job.lines[0] and "has made no progress for 13 s" in job.lines[0]  # (seen a tick late)
    assert "in phase checkpoint of iteration 1" in job.lines[0]
