"""When, after an iteration, the engines take the learner's weights, a checkpoint is saved and the
held-out set is evaluated: one rule for all three, built once from the config.

Every answer is the same on every rank (pushes and checkpoints are collectives); only rank 0
evaluates. ``trained``: iterations trained so far (the learner's weight version after iteration
``trained - 1``).

Pushes (docs/algorithm.md "Overlapped rollouts"): with ``rollout.max_staleness`` K = 0 after every
iteration. With K >= 1 the engines start the next batch with the weights they serve, and it trains
one iteration later; they get new weights when, without them, that batch would be more than K
versions old when trained (K = 1: after every iteration; K = 2: every other one), and whenever they
must serve the newest weights: before a checkpoint (it saves the batch ahead), an evaluation (it
measures the weights the engines serve) and after the last iteration. Colocated engines on GPUs
hold no weights after the learner trained (they hand it their memory): a push after every iteration.
"""
from __future__ import annotations


class Cadence:
    def __init__(self, iterations: int, max_staleness: int = 0, engines_release_memory: bool = False,
                 save_interval: int = 0, evaluating: bool = False, eval_interval: int = 0,
                 eval_before_training: bool = False):
        """``save_interval`` / ``eval_interval``: iterations between checkpoints / evaluations (0: none
        / only before and after training); ``evaluating``: the run has a held-out set
        (``eval.path``); ``engines_release_memory``: colocated engines on GPUs (rollout/fleet.py)."""
        self.iterations = iterations
        self.max_staleness = max_staleness
        self.engines_release_memory = engines_release_memory
        self.save_interval = save_interval
        self.evaluating = evaluating
        self.eval_interval = eval_interval
        self.eval_before_training = eval_before_training

    @classmethod
    def from_config(cls, cfg, engines_release_memory: bool) -> Cadence:
        return cls(iterations=cfg.trainer.iterations, max_staleness=cfg.rollout.max_staleness,
                   engines_release_memory=engines_release_memory, save_interval=cfg.checkpoint.save_interval,
                   evaluating=cfg.eval.path is not None, eval_interval=cfg.eval.interval,
                   eval_before_training=cfg.eval.before_training)

    def last(self, trained: int) -> bool:
        return trained == self.iterations

    def checkpoint(self, trained: int) -> bool:
        return bool(self.save_interval) and trained % self.save_interval == 0

    def evaluate_before_training(self, start_iteration: int) -> bool:
        """Whether the held-out set is evaluated before the first iteration (not when resuming)."""
        return self.evaluating and start_iteration == 0 and self.eval_before_training

    def evaluate(self, trained: int) -> bool:
        return self.evaluating and (bool(self.eval_interval and trained % self.eval_interval == 0)
                                    or self.last(trained))

    def needs_complete_batch(self, trained: int) -> bool:
        """Whether the push after ``trained`` iterations waits for the batch in flight even with partial
        rollouts: a checkpoint saves it whole, an evaluation measures the engines alone, the end has
        nothing to pause for."""
        return self.checkpoint(trained) or self.evaluate(trained) or self.last(trained)

    def push(self, trained: int, served: int) -> bool:
        """Whether the weights after ``trained`` iterations go to the engines (serving version
        ``served``) now; the batch they start next is trained at iteration ``trained + 1``."""
        too_stale = trained + 1 - served > self.max_staleness
        return (self.checkpoint(trained) or self.evaluate(trained) or self.last(trained)
                or not self.max_staleness or self.engines_release_memory or too_stale)
