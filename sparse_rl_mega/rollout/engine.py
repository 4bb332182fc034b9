"""One SGLang rollout engine with the sparse-rl-mega KV patch, and the calls the trainer makes on it.

The engine runs in SGLang's own processes: tokenizer manager here, scheduler and detokenizer spawned
(GPU) or forked from a server that imported SGLang once (CPU: ``rollout/forkserver.py``). The tokenizer
manager's event loop runs on one thread of this process for the engine's life, and every call is a
coroutine on it (``sglang_internals``): a weight push, a pause or a probe runs while a generation
waits, as they would on SGLang's server.
KV-compression settings reach the scheduler through the environment (see ``sparse_rl_mega.kv.engine_settings``);
the plugin itself is loaded there through SGLang's entry point.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional
from collections.abc import Awaitable, Sequence

import torch

from sparse_rl_mega.batch import GeneratedSample
from sparse_rl_mega.config.hf import hf_shape
from sparse_rl_mega.kv.engine_settings import ENV_VAR, REQUEST_KEY, EngineKVSettings
from sparse_rl_mega.rollout import forkserver, sglang_internals, shm_record
from sparse_rl_mega.rollout.engine_args import check_engine_tp, check_request_kv, server_arguments, support_cap
from sparse_rl_mega.rollout.engine_processes import (engine_process_env, exit_description, keep_process_on_child_crash,
                                                     own_event_loop, process_names, without_launcher_env)
from sparse_rl_mega.rollout.generation import PendingGeneration
from sparse_rl_mega.runtime import watchdog


class EngineFailure(RuntimeError):
    """An engine call that cannot complete: one of the engine's processes died, or the engine gave no
    answer (no output, no reply) for ``timeout_s``. The engine is unusable afterwards (every later
    call raises this again); the supervisor (``rollout/supervisor.py``) restarts it."""

    def __init__(self, engine: str, phase: str, reason: str):
        self.engine, self.phase, self.reason = engine, phase, reason
        super().__init__(f"{engine} failed in {phase}: {reason}")

DEFAULT_ENGINE_TIMEOUT_S = 600.0  # no answer for this long is a hang (a 70B bucket takes seconds)

_POLL_S = 0.25  # how often a waiting call checks the engine's processes

FLUSH_WAIT_S = 30.0  # an idle engine empties its prefix cache at the second attempt

# rollout.partial's KV choices at a weight push (docs/algorithm.md "Partial rollouts") and SGLang's
# pause mode for each: the paused requests keep their compressed KV as it is ("stale"), or are
# retracted and prefilled again, prompt and output so far, under the new weights ("reprefill")
PAUSE_MODES = {"stale": "in_place", "reprefill": "retract"}

# torchrun's variables describe the learner's process group; SGLang's spawned processes read some of
# them (RANK, WORLD_SIZE, MASTER_PORT, ...) when they build their own group and would wait for peers
# that never come.
WEIGHT_GROUP = "sparse_rl_mega_weights"

_SGLANG_ENGINES: list = []  # every SGLang Engine this process made (RolloutEngine.__init__: why)


class RolloutEngine:
    def __init__(self, model_path: str, kv: EngineKVSettings, *, dtype: str = "float32", seed: int = 0,
                 max_total_tokens: Optional[int] = None, max_running_requests: Optional[int] = None,
                 mem_fraction_static: float = 0.8, attention_backend: Optional[str] = None,
                 tp_size: int = 1, base_gpu_id: int = 0, memory_saver: bool = False, log_level: str = "error",
                 prompt_tokens: int = 1024, timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S, name: str = "engine",
                 support_top_k: Optional[int] = None, log=print):
        """``timeout_s``: a call that gets no answer from the engine for this long fails
        (:class:`EngineFailure`), as does one whose engine processes died; ``name`` names the engine in
        those errors. ``base_gpu_id``: the node-local GPU of the engine's TP rank 0 (GPU only); ``memory_saver``:
        start with SGLang's memory saver so :meth:`release_memory` can free weights and KV pool while a
        colocated learner trains (GPU only). On a GPU, the KV patch's side buffers (query ring, H2O's
        mass for requests of up to ``prompt_tokens`` prompt tokens) are taken out of
        ``mem_fraction_static`` before SGLang sizes its KV pool, and scoring policies run without CUDA
        graphs (:func:`cuda_graphs_allowed`). ``support_top_k``: the ``top_k`` (-1: top-p alone) of
        the requests that will report their sampling support (:meth:`start_generate`'s
        ``report_support``); None: no request will. Another SGLang than the patch's raises
        :class:`~sparse_rl_mega.rollout.sglang_internals.SGLangVersionError` (one line) before anything starts."""
        sglang_internals.check_version()
        check_engine_tp(model_path, kv, tp_size)
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1" if not torch.cuda.is_available() else "0")
        os.environ[ENV_VAR] = kv.to_env()
        import sglang as sgl

        on_cpu = not torch.cuda.is_available()
        self.vocab_size = hf_shape(model_path)["vocab"]
        self.support_cap = None if support_top_k is None else support_cap(support_top_k, self.vocab_size)
        kwargs = server_arguments(model_path, kv, on_cpu=on_cpu, dtype=dtype, seed=seed, tp_size=tp_size,
                                  mem_fraction_static=mem_fraction_static, log_level=log_level,
                                  attention_backend=attention_backend, base_gpu_id=base_gpu_id,
                                  memory_saver=memory_saver, max_total_tokens=max_total_tokens,
                                  max_running_requests=max_running_requests, prompt_tokens=prompt_tokens,
                                  sampling_support=self.support_cap, log=log)
        self.kv = kv
        self.model_path = model_path
        engine_class = sgl.Engine  # (its module sets uvloop's event loop policy on import)
        sglang_internals.announce_load_snapshot_files(lambda path: shm_record.note(f"file {path}"))
        interpreted = kwargs.get("attention_backend") == "triton"  # (on a CPU: under Triton's interpreter)
        with engine_process_env(on_cpu, triton_interpreter=interpreted), own_event_loop():
            if on_cpu:  # processes forked from a server that imported SGLang once (rollout/forkserver.py)
                forkserver.use_forkserver()
            self.engine = engine_class(**kwargs)
        # SGLang's Engine registers its shutdown to run at exit, which SIGKILLs every descendant of this
        # process: the reward workers, other engines, and multiprocessing's resource tracker, which the
        # exit's own clean-up then finds dead ("process died unexpectedly", a KeyError from the new one).
        # This engine's processes are ended by shutdown() / kill(), or die with this process
        # (PR_SET_PDEATHSIG), so that handler goes. The Engine object stays referenced for the process's
        # life, as that handler kept it: collected, a killed engine's zmq context would run term(), which
        # blocks for ever on its sockets to the dead processes (seen: a test hung in the next Engine())
        atexit.unregister(self.engine.shutdown)
        _SGLANG_ENGINES.append(self.engine)
        keep_process_on_child_crash()  # replaces SGLang's kill-everything handler (main thread only)
        self.tp_size = tp_size
        self.name, self.timeout_s = name, timeout_s
        # every call to SGLang is a coroutine on the engine's loop, run by this thread for the engine's
        # life, while the caller watches the engine's processes
        self._loop_thread = threading.Thread(target=_run_loop, args=(sglang_internals.engine_loop(self.engine),),
                                             name=f"{name}-loop", daemon=True)
        self._loop_thread.start()
        self.in_flight: list[PendingGeneration] = []  # generations started and not finished
        self._rids = itertools.count()
        self.paused: Optional[str] = None  # the KV choice of a pause (PAUSE_MODES) until resume()
        self.flush_owed = False  # a flush asked while requests ran: done before the next generation starts
        self.failure: Optional[EngineFailure] = None
        self.processes = process_names(self.engine.get_all_child_pids())  # {pid: name}
        shm_record.note("pids " + " ".join(map(str, self.processes)))
        self.on_cpu = on_cpu
        self.started = forkserver.how_started(self.processes)  # (said in start-up lines)
        self.on_shutdown = None  # called after shutdown (EngineStart releases its thread)
        self.weight_version = 0  # 0: the weights loaded from model_path

    @property
    def forked(self) -> bool:
        """Whether the engine's processes were forked from a preloaded server (else spawned)."""
        return self.started != "spawned"

    # ------------------------------------------------------------------ generation
    def generate(self, prompts_ids: Sequence[Sequence[int]], n_samples: int, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, seed: Optional[int] = None,
                 kv_override: Optional[dict] = None, ignore_eos: bool = False,
                 prompt_offset: int = 0, top_k: int = -1, report_support: bool = False) -> list[GeneratedSample]:
        """``n_samples`` responses per prompt (see :meth:`start_generate`), waited for."""
        return self.start_generate(prompts_ids, n_samples, max_new_tokens, temperature, top_p, seed, kv_override,
                                   ignore_eos, prompt_offset, top_k, report_support).result()

    def start_generate(self, prompts_ids: Sequence[Sequence[int]], n_samples: int, max_new_tokens: int,
                       temperature: float = 1.0, top_p: float = 1.0, seed: Optional[int] = None,
                       kv_override: Optional[dict] = None, ignore_eos: bool = False,
                       prompt_offset: int = 0, top_k: int = -1, report_support: bool = False
                       ) -> PendingGeneration:
        """Start sampling ``n_samples`` responses per prompt, groups contiguous (prompt-major order), and
        return at once: the engine decodes in its own processes while the caller works (overlapped
        rollouts); :meth:`PendingGeneration.result` waits, watching the engine as every call does. Other
        calls run meanwhile (a weight push with :meth:`pause`, a probe); a flush is then owed
        (:meth:`flush_cache`).

        All samples of a prompt are sent in one call so the group's shared prompt is prefilled once
        and then served from the radix cache. ``kv_override`` (e.g. ``{"policy": "rkv", "budget": 64}``
        or ``{"policy": "none"}``) replaces the engine's KV settings for these requests; the engine must
        have been started with ``allow_request_override``, unless the override is only a budget no larger
        than the engine's (``{"budget": 48}``: the automatic budget). Sample ``s`` of prompt ``i`` is sampled with
        seed ``seed + (prompt_offset + i) * n_samples + s``: an engine given a shard of an iteration's
        prompts (``prompt_offset`` = the shard's first prompt) draws what one engine given them all would.

        ``top_k`` (-1: off) and ``top_p`` truncate each step's distribution (SGLang: top-k, then top-p
        on the untruncated cumulative mass). With ``report_support`` every sample carries the ids the
        truncation kept at each step (``GeneratedSample.support``) and its ``logp_sparse`` is the logprob
        renormalised over them, the probability the token was drawn with (SGLang's
        ``return_sampling_mask``; top-p alone is sent as top-k = the vocabulary, which SGLang requires
        for it and which keeps every token); without it, the logprob of the untruncated distribution."""
        cap = support_cap(top_k, self.vocab_size)
        if report_support and (self.support_cap is None or cap > self.support_cap):
            raise ValueError(f"{self.name} reports sampling supports of at most {self.support_cap} tokens "
                             f"(support_top_k at its start); a request at top_k {top_k} needs {cap}")
        custom = None
        if kv_override is not None:
            check_request_kv(self.kv, kv_override)  # raises here, not in the scheduler
            custom = {REQUEST_KEY: dict(kv_override)}
        if self.flush_owed and not self.in_flight:
            self.flush_cache("rollout")  # nothing cached under older weights may serve these requests
        input_ids, params = [], []
        for p_index, ids in enumerate(prompts_ids):
            for s in range(n_samples):
                input_ids.append(list(ids))
                sp = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
                      "ignore_eos": ignore_eos}
                if top_k > 0 or report_support:
                    sp["top_k"] = cap
                if custom is not None:
                    sp["custom_params"] = custom
                if seed is not None:
                    sp["sampling_seed"] = seed + (prompt_offset + p_index) * n_samples + s
                params.append(sp)
        started_at = time.time()
        rids = [f"{self.name}-{next(self._rids)}" for _ in input_ids]
        # a prefix cached under other weights must not serve these requests (the cache is emptied at every
        # push, but not while requests run: flush_cache)
        future = self._submit(sglang_internals.generate(self.engine, input_ids, params, rids, report_support,
                                                        cache_key=f"weights-{self.weight_version}"))
        return PendingGeneration(self, future, input_ids, n_samples, started_at, report_support)

    def dense_logprobs(self, token_ids: Sequence[int], phase: str = "logprob check") -> list[float]:
        """Logprob of ``token_ids[1:]`` given their prefixes, from one (never compressed) prefill
        (``phase``: what a failure names)."""
        if self.paused:
            raise RuntimeError(f"{self.name} is paused: a probe request would wait until resume()")
        out = self._call(phase, sglang_internals.generate(self.engine, list(token_ids),
                                                          {"max_new_tokens": 1, "temperature": 0.0},
                                                          logprob_start_len=0))
        values = [entry[0] for entry in out["meta_info"]["input_token_logprobs"]]
        return [float(v) for v in values[1:]]  # the first token has no prediction

    # ------------------------------------------------------------------ weights
    # A push (rollout/weight_push.py): begin_update(), one flattened bucket at a time (submit_flat_bucket
    # or submit_flat_receive, then wait_bucket), the last one carrying the new version, end_update().
    def begin_update(self) -> None:
        """Open SGLang's weight-update session (``begin_weight_update``)."""
        self.wait_begin_update(self.submit_begin_update())

    def submit_begin_update(self) -> Future:
        return self._submit(sglang_internals.begin_weight_update(self.engine))

    def wait_begin_update(self, submitted: Future) -> None:
        ok, message = self._wait("weight push", submitted)
        if not ok:
            raise RuntimeError(f"{self.name} could not begin a weight update: {message}")

    def end_update(self, version: int) -> None:
        """Close the session, flush the prefix cache (no KV computed with the old weights is reused; with
        requests in flight, before the next generation starts: :meth:`flush_cache`) and note ``version``,
        which the last bucket gave the engine (every later sample reports it)."""
        self._call("weight push", sglang_internals.end_weight_update(self.engine))
        self.flush_cache("weight push")
        self.weight_version = version

    # ------------------------------------------------------------------ partial rollouts
    def pause(self, kv: str) -> int:
        """Pause the generations in flight before a weight push (``rollout.partial``): ``kv`` "stale"
        keeps each request's KV, compressed as it is, and its eviction state; "reprefill" retracts them
        (SGLang frees their KV; the KV patch counts a retraction and starts their eviction state anew)
        and :meth:`resume` prefills prompt and output so far again under the new weights. Tokens sampled
        after the push report its version (``GeneratedSample.token_versions``). Returns the number of
        generations paused (0: none in flight, nothing to pause)."""
        if kv not in PAUSE_MODES:
            raise ValueError(f"unknown partial-rollout KV choice {kv!r}; expected one of {sorted(PAUSE_MODES)}")
        if not self.in_flight:
            return 0
        self._call("pause", sglang_internals.pause_generation(self.engine, PAUSE_MODES[kv]))
        self.paused = kv
        return len(self.in_flight)

    def resume(self) -> None:
        """Continue the paused generations (after the push). Retracted requests are prefilled from the
        prefix cache the push emptied (:meth:`end_update`), so no KV of the old weights serves them."""
        if self.paused is None:
            return
        self._call("resume", sglang_internals.continue_generation(self.engine))
        self.paused = None

    def submit_flat_bucket(self, payloads: list[bytes], version: Optional[int] = None) -> Future:
        """Ask the engine to load one flattened bucket that its ranks read from a shared buffer
        (``payloads``: one serialized bucket per TP rank, ``weight_push.serialize_bucket``); with
        ``version`` (the last bucket) it serves that weight version from then on."""
        return self._submit(sglang_internals.load_flattened_bucket(self.engine, payloads, _version(version)))

    def submit_flat_receive(self, slots, dtype: torch.dtype, group_name: str, version: Optional[int] = None) -> Future:
        """Ask the engine to receive one flattened bucket that member 0 of weight group ``group_name``
        broadcasts (``slots``: its tensors' names and shapes, in order; ``version`` as above)."""
        return self._submit(sglang_internals.receive_flattened_bucket(
            self.engine, [s.name for s in slots], str(dtype).replace("torch.", ""), [list(s.shape) for s in slots],
            group_name, _version(version)))

    def wait_bucket(self, submitted: Future) -> None:
        """Wait for a bucket's load; one the engine refused raises (its message)."""
        ok, message = self._wait("weight push", submitted)
        if not ok:
            raise RuntimeError(f"{self.name} refused a weight bucket: {message}")

    def broadcast_failed(self, exc: Exception) -> EngineFailure:
        """This engine failed, as a broadcast to its weight group did (its processes are checked for why)."""
        try:
            self._fail("weight push", self._health(time.time())
                       or f"the weight broadcast failed: {str(exc).splitlines()[0]}")
        except EngineFailure as failure:
            return failure

    def submit_join_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 backend: str, group_name: str) -> Future:
        """Ask this engine's ranks to join the weight group whose member 0 listens at
        ``master_address:master_port``, as members ``rank_offset .. rank_offset + tp - 1`` (on the call
        thread: it returns once every member joined)."""
        with without_launcher_env():  # (the scheduler joins; this process only sends the request)
            return self._submit(sglang_internals.join_weight_group(self.engine, master_address, master_port,
                                                                   rank_offset, world_size, group_name, backend))

    def wait_join_weight_group(self, joining: Future) -> None:
        ok, message = self._wait("weight group", joining)
        if not ok:
            raise RuntimeError(f"{self.name} could not join the weight-update group: {message}")

    def release_memory(self) -> None:
        """Free the weights and KV pool for the colocated learner's training phase (GPU, memory saver)."""
        self._call("memory release", sglang_internals.release_memory(self.engine))

    def resume_memory(self) -> None:
        """Take the memory back before the next weight push and rollout. The learner's cached free
        blocks are returned to the GPU first: the engine's weights and KV pool go back to their
        addresses, and the caching allocator would otherwise keep what training freed."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self._call("memory resume", sglang_internals.resume_memory(self.engine))

    def served_weight_version(self) -> str:
        """The weight version the engine reports serving."""
        return sglang_internals.served_weight_version(self.engine)

    def flush_cache(self, phase: str = "cache flush") -> None:
        """Empty the prefix cache (the next rollout starts from the same state whatever ran before).

        SGLang refuses a flush while the batch of a request that just finished is still its last batch
        (until its next idle pass), answering ``success=False`` with a warning our log level hides: a
        flush sent right after a request used to fail now and then, leaving that request's prefix cached
        (rollouts then depended on timing). Each attempt wakes the scheduler, whose idle pass clears that
        batch: ask again until it succeeds, for at most ``FLUSH_WAIT_S``.

        While generations are in flight (a partial rollout goes on after a push) SGLang refuses: the
        cached prefixes no request holds are dropped instead, and the flush is owed to the next
        generation that starts on an idle engine. Requests started meanwhile match only prefixes
        cached under the weights they start with (:meth:`start_generate`'s cache key). Requests
        retracted by a "reprefill" pause are waiting, not running: SGLang flushes then, and must
        (they are prefilled again at resume and would match the old weights' prompt KV). An engine
        paused in place refuses too, even with nothing left running: its last batch stays its last
        batch until it decodes again."""
        if self.paused == "stale" or (self.in_flight and self.paused != "reprefill"):
            self._call(phase, sglang_internals.drop_cached_prefixes(self.engine, self.timeout_s))
            self.flush_owed = True
            return
        deadline = time.time() + FLUSH_WAIT_S
        while not self._call(phase, sglang_internals.flush_cache(self.engine)):
            if time.time() > deadline:
                self._fail(phase, f"its prefix cache could not be emptied for {FLUSH_WAIT_S:g} s (requests "
                                  f"still running)")
            time.sleep(0.005)
        self.flush_owed = False

    # ------------------------------------------------------------------ stats and lifetime
    def kv_stats(self) -> dict:
        """Engine KV statistics: cumulative eviction counters and the peak pool use since last call."""
        return dict(self.internal_state().get("sparse_rl_kv", {}))

    def resolved(self) -> dict:
        """What the first scheduler runs, as SGLang resolved it (``sglang_internals.hook_scheduler_built``):
        page size, attention backends, sampling backend, overlap, speculation, decode CUDA graph sizes."""
        return dict(self.internal_state()["resolved"])

    def internal_state(self) -> dict:
        """The first scheduler's internal state (SGLang's, with the KV patch's ``sparse_rl_kv``)."""
        return self._call("rollout", sglang_internals.internal_states(self.engine))[0]

    def shutdown(self) -> None:
        """End the engine by its own processes (:meth:`kill`), on a GPU as on a CPU. Never SGLang's
        ``Engine.shutdown``: it runs ``kill_process_tree(os.getpid(), include_parent=False)``, which
        SIGKILLs every child of this process (reward workers, multiprocessing's resource tracker, the
        CPU engines' forkserver, another engine); SIGKILL is what it sends to the engine's processes too."""
        self.kill()

    def kill(self) -> None:
        """SIGKILL the engine's processes (scheduler(s), detokenizer and their children) and wait for
        them (at most 30 s). This process's other children
        (reward workers, the CPU engines' forkserver and its other engines) stay."""
        import psutil

        if self.engine is None:
            return
        sglang_internals.stop_subprocess_watchdog(self.engine)  # it would report the deaths below with SIGQUIT
        procs = []
        for pid in self.processes:
            try:
                proc = psutil.Process(pid)
                procs += proc.children(recursive=True) + [proc]
            except psutil.NoSuchProcess:
                continue
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)
        for pid in self.processes:  # reap them (multiprocessing would otherwise leave zombies)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # (a forkserver's child: the server reaps it)
                pass
        forkserver.forget(self.processes)
        self._release_loop()
        shm_record.remove_engine_files(self.engine, self.processes)
        self.engine = None
        if self.on_shutdown is not None:
            self.on_shutdown()

    def _release_loop(self) -> None:
        """Cancel the tokenizer manager's tasks, stop the engine's loop and its thread (bounded: a call
        stuck on a dead engine was cancelled by :meth:`_fail`) and close the loop."""
        loop = sglang_internals.engine_loop(self.engine)

        async def cancel_the_others() -> None:
            tasks = [task for task in asyncio.all_tasks(loop) if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._loop_thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_the_others(), loop).result(timeout=5)
            except Exception:  # noqa: BLE001 (a task that does not end: the loop stops anyway)
                pass
            loop.call_soon_threadsafe(loop.stop)
            self._loop_thread.join(timeout=5)
        if not loop.is_running():
            loop.close()
        self.in_flight = []

    # ------------------------------------------------------------------ calls with deadlines
    def _submit(self, call: Awaitable) -> Future:
        """Run the coroutine ``call`` on the engine's loop; its future at once."""
        if self.failure is not None:
            call.close()
            raise self.failure

        async def checked():
            if self.failure is not None:  # queued before the engine failed: never sent to it
                call.close()
                raise self.failure
            return await call
        return asyncio.run_coroutine_threadsafe(checked(), sglang_internals.engine_loop(self.engine))

    def _wait(self, phase: str, future: Future):
        """The result of a submitted call; :class:`EngineFailure` naming ``phase`` when an engine process
        dies or nothing comes back from the engine for ``timeout_s`` (checked every 0.25 s)."""
        started = time.time()
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except FutureTimeout:
                pass
            except CancelledError:  # by _fail: the engine failed meanwhile
                raise self.failure or EngineFailure(self.name, phase, "its call was cancelled") from None
            reason = self._health(started)
            if reason is not None:
                self._fail(phase, reason)
            watchdog.beat()  # an engine that answers within rollout.engine_timeout_s is progress

    def _call(self, phase: str, call: Awaitable):
        return self._wait(phase, self._submit(call))

    def _health(self, waiting_since: float) -> Optional[str]:
        """Why the engine cannot answer (a process gone, or silent for ``timeout_s``), else None."""
        import psutil

        stopped = []
        for pid, name in self.processes.items():
            try:
                status = psutil.Process(pid).status()
            except psutil.NoSuchProcess:  # reaped already (a forkserver's child: by the server, at once)
                status = psutil.STATUS_DEAD
            if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return f"its {name} process (pid {pid}) died{exit_description(pid)}"
            if status == psutil.STATUS_STOPPED:
                stopped.append(f"{name} (pid {pid}) is stopped")
        silent = time.time() - max(waiting_since, sglang_internals.last_answer_time(self.engine))
        if silent > self.timeout_s:
            return (f"no answer for {silent:.0f} s (rollout.engine_timeout_s={self.timeout_s:g})"
                    + (f"; its {', '.join(stopped)}" if stopped else ""))
        return None

    def _fail(self, phase: str, reason: str):
        """Mark the engine failed and raise; the work pending on its loop is cancelled."""
        self.failure = EngineFailure(self.name, phase, reason)
        loop = sglang_internals.engine_loop(self.engine)
        loop.call_soon_threadsafe(lambda: [task.cancel() for task in asyncio.all_tasks(loop)])
        raise self.failure


def _version(version: Optional[int]) -> Optional[str]:
    return None if version is None else str(version)


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The engine's loop thread: the tokenizer manager's loop, current here, until the engine stops it."""
    asyncio.set_event_loop(loop)
    loop.run_forever()
