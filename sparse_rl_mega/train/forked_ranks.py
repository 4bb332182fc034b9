"""Single-node CPU jobs: the learner ranks are forks of a server that imported their modules once.

Every rank of a job imports torch, Megatron-Core and its learner (~10 CPU-s on these 2-core machines),
and a rank that hosts an engine SGLang and MLflow too (~15 more): on a CPU, start-up is mostly
imports. ``tools/launch.py`` imports them once (:func:`start_rank_server`), forks multiprocessing's
forkserver from itself (``process_server.py``) and runs torchrun's agent with a function entrypoint
and the ``forkserver`` start method: each rank is a fork of that server (torchrun's own path for
function entrypoints), and runs ``tools/launch.py`` as a script (:func:`run_rank`), as an
exec'd rank would, under the launcher's environment of that moment plus torchrun's variables.

Modules read some settings as they are imported: the ranks' modules are imported under the launcher's
environment, SGLang's under the engine processes' (``rollout.engine.preload_cpu_engines``), as an
exec'd rank would import them; an engine-hosting rank still forks its engines' server from itself.
Megatron-Core is imported before the rank installs the CPU shims (``learner/cpu_shims.py``): they
replace ``torch.cuda`` functions that Megatron looks up as it calls them, not names it binds at import.
``tools/export_hf.py`` and the suite's torchrun sessions (``tests/helpers/torchrun_forked.py``) start
their ranks the same way.

GPU machines (CUDA state must not be forked) and multi-node jobs (``torchrun tools/launch.py`` on every
node) exec their ranks as before.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Optional

from sparse_rl_mega.rollout.engine_processes import import_cpu_engine_modules
from sparse_rl_mega.rollout.placement import hosts_an_engine
from sparse_rl_mega.runtime import process_server
from sparse_rl_mega.runtime.ports import free_port

# what a rank imports beyond tools/launch.py: the entry point, and with it the trainer, the learner
# (Megatron-Core as its functions first use it), its checkpoints, the engine fleet and the tracker (MLflow
# itself as first used: not its SQL store, which loads pyarrow, whose allocator starts a thread)
RANK_MODULES = ("sparse_rl_mega.train.entry",)
# os.environ as the server was forked (the ranks inherit it): what differs in a rank is torchrun's
_server_environment: Optional[dict[str, str]] = None


def start_rank_server(modules=RANK_MODULES, engine_modules: bool = False) -> bool:
    """Import ``modules`` (and SGLang's, under the engine processes' environment, with
    ``engine_modules``), then fork the ranks' server from this process (one thread running, no server
    yet, no GPU). False (nothing forked) where the ranks must be exec'd instead."""
    global _server_environment
    import torch

    if torch.cuda.is_available() or not process_server.can_fork_server():
        return False
    if engine_modules:
        import_cpu_engine_modules()
    for name in modules:
        importlib.import_module(name)
    if not process_server.can_fork_server():  # (an import started a thread)
        return False
    _server_environment = dict(os.environ)
    process_server.fork_server()
    return True


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
    elastic_launch(config=config, entrypoint=run_rank)(dict(os.environ), torchrun_args.training_script,
                                                      torchrun_args.training_script_args)


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
    """Whether this rank is a fork of the launcher's rank server (said in the start-up line)."""
    return _server_environment is not None and "LOCAL_RANK" in os.environ


def run_rank(environment: dict[str, str], script: str, argv: list[str]) -> None:
    """A rank (torchrun's function entrypoint, in a fork of the rank server): ``environment`` (the
    launcher's as it started the job) plus the variables torchrun set for this rank, then ``script``
    run as ``__main__`` with ``argv``, unbuffered as torchrun's ``python -u`` would run it."""
    torchrun_vars = {k: v for k, v in os.environ.items() if _server_environment.get(k) != v}
    process_server.take_environment({**environment, **torchrun_vars})
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    process_server.run_script(script, argv)

