"""Single-node CPU jobs: the learner ranks are children of a warm server (``runtime/warm_fork.py``).

Every rank of a job imports torch, Megatron-Core and its learner (~10 CPU-s on these 2-core machines),
and a rank that hosts an engine SGLang and MLflow too (~15 more): on a CPU, start-up is mostly
imports. ``tools/launch.py`` makes its warm server import them once (:func:`start_rank_server`) and
runs torchrun's agent with a function entrypoint and the ``forkserver`` start method: each rank is a
child of that server (torchrun's own path for function entrypoints) and runs ``tools/launch.py`` as a
script (:func:`run_rank`), as an exec'd rank would, under the launcher's environment of that moment
plus torchrun's variables, with the launcher's output. An engine-hosting rank then starts its own
warm server for its engines (``rollout/forkserver.py``).

Megatron-Core is imported before the rank installs the CPU shims (``learner/cpu_shims.py``): they
replace ``torch.cuda`` functions that Megatron looks up as it calls them, not names it binds at import.
``tools/export_hf.py`` and the suite's torchrun sessions start their ranks the same way
(:func:`run_script_ranks`).

GPU machines (CUDA state must not be forked) and multi-node jobs (``torchrun tools/launch.py`` on every
node) exec their ranks as before, and so does a launcher whose warm server imported its modules under
another environment (:func:`runtime.warm_fork.serves`).
"""
from __future__ import annotations

import os
import sys
from sparse_rl_mega.rollout.placement import hosts_an_engine
from sparse_rl_mega.runtime import warm_fork
from sparse_rl_mega.runtime.ports import free_port

# what a rank imports beyond tools/launch.py: the entry point, and with it the trainer, the learner
# (Megatron-Core as its functions first use it), its checkpoints, the engine fleet and the tracker (MLflow
# itself as first used: not its SQL store, which loads pyarrow, whose allocator starts a thread); and the
# math reward's verifier, warmed (its workers are forks of the rank's engine server, or of one of their own)
RANK_MODULES = ("sparse_rl_mega.train.entry", "sparse_rl_mega.reward.math_worker:warm_up")
# SGLang's modules, imported under the engine processes' environment (before the rank's: a rank that hosts an
# engine forks its engines' server from itself)
ENGINE_MODULES = ("sparse_rl_mega.rollout.engine_processes:import_cpu_engine_modules",)
_forked = False  # whether this process's ranks are children of its warm server


def start_rank_server(modules=RANK_MODULES, engine_modules: bool = False) -> bool:
    """Make this process's warm server import ``modules`` (first SGLang's, under the engine processes'
    environment, with ``engine_modules``). False where the ranks must be exec'd instead (a GPU; a
    server that imported its modules under another environment)."""
    global _forked
    import torch

    if torch.cuda.is_available():
        return False
    _forked = warm_fork.start_server([*(ENGINE_MODULES if engine_modules else ()), *modules])
    return _forked


def start_job_rank_server(cfg) -> bool:
    """:func:`start_rank_server` for the ranks of a single-node job ``cfg`` (``tools/launch.py``)."""
    if cfg.parallel.nnodes != 1:
        return False
    hosts = any(hosts_an_engine(cfg, rank) for rank in range(cfg.parallel.nproc_per_node))
    return start_rank_server(RANK_MODULES, engine_modules=hosts)


def run_agent(torchrun_args, forked: bool) -> None:
    """torchrun's ``run`` for ``torchrun_args`` (its parsed command line; a static rendezvous on this
    node) with its agent in this process: the ranks are ``python -u`` processes, or with ``forked``
    forks of the server :func:`start_rank_server` made (a function entrypoint). Raises torchrun's
    ``ChildFailedError`` when a rank fails."""
    import torch.multiprocessing
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    torch.multiprocessing._set_thread_name("pt_elastic")  # (as torchrun's run names its agent)
    config, command, script_args = config_from_args(torchrun_args)
    if not forked:
        elastic_launch(config=config, entrypoint=command)(*script_args)
        return
    config.start_method = "forkserver"
    elastic_launch(config=config, entrypoint=run_rank)(dict(os.environ), warm_fork.caller_stdio(),
                                                      torchrun_args.training_script, torchrun_args.training_script_args)


def run_on_this_node(nproc: int, script: str, script_args: list[str], forked: bool) -> None:
    """``torchrun --nproc-per-node NPROC SCRIPT ARGS`` on this node (a static rendezvous on loopback, a
    free port) through :func:`run_agent`; raises torchrun's ``ChildFailedError`` when a rank fails."""
    from torch.distributed.run import get_args_parser

    command = ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               script, *script_args]
    run_agent(get_args_parser().parse_args(command), forked)


def run_script_ranks(nproc: int, script: str, script_args: list[str], forked: bool, name: str) -> int:
    """:func:`run_on_this_node`: 0, or 1 after one line ``[name] rank R failed (exit code C)``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run_on_this_node(nproc, script, script_args, forked)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"[{name}] rank {rank} failed (exit code {failure.exitcode})", file=sys.stderr)
        return 1
    return 0


def forked_rank() -> bool:
    """Whether this rank is a child of its launcher's warm server (said in the start-up line)."""
    return _forked and "LOCAL_RANK" in os.environ


def run_rank(environment: dict[str, str], stdio, script: str, argv: list[str]) -> None:
    """A rank (torchrun's function entrypoint, a child of the warm server): ``environment`` (the
    launcher's as it started the job) plus the variables torchrun set for this rank, the launcher's
    ``stdio``, unbuffered as torchrun's ``python -u`` would run it, then ``script`` run as ``__main__``
    with ``argv`` (``runtime.warm_fork``: as a fresh interpreter)."""
    global _forked
    torchrun_vars = warm_fork.variables_set_since_start()
    warm_fork.become_fresh({**environment, **torchrun_vars}, stdio)
    _forked = True
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    warm_fork.end_as_interpreter(lambda: warm_fork.run_script(script, argv))
