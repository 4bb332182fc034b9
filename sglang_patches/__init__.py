"""SGLang plugin of sparse-rl-mega, loaded in every SGLang process through the ``sglang.srt.plugins``
entry point (see setup.py). It refuses any SGLang but the one it was written for
(``sglang_internals.check_version``), then installs its hooks, all through ``sglang_internals``, the one
module that touches SGLang's internals. Settings arrive in the ``SPARSE_RL_MEGA_KV`` environment
variable; without it (or with ``policy: none``) the engine decodes exactly as stock SGLang and only
reports pool usage (``kv_eviction``). On CPU, weight pushes keep their shared buffers mapped and cache
flushes skip a full garbage collection (``push_buffers``). With the ``pytorch`` sampling backend, a
request's ``sampling_seed`` always decides its tokens (``sglang_internals.hook_sampling_seeds``). Each
scheduler, once built, is checked against what the patch needs (``_check_scheduler``). With
``check_attention_metadata`` every decode step's backend metadata is checked against the patch's rows
(``metadata_check``).
Weight-loading bars are drawn only over several shard files (``loading_bar``)."""
import os

_installed = False


def register() -> None:
    """SGLang's loader logs and swallows an Exception from a plugin, and the engine would then decode
    dense while its callers believe it compresses: any failure here ends the process instead, in one
    line (SystemExit is not an Exception), so the engine's start fails."""
    try:
        _register()
    except Exception as exc:  # noqa: BLE001 (any failure: the engine must not start without the patch)
        raise SystemExit(f"sparse-rl-mega's SGLang plugin failed in process {os.getpid()} "
                         f"({type(exc).__name__}: {exc}): the engine must not run without it") from None


def _register() -> None:
    global _installed
    if _installed or os.environ.get("SPARSE_RL_MEGA_PLUGIN_OFF") == "1":
        return
    from sglang_patches import loading_bar, metadata_check, push_buffers
    from sglang_patches.kv_eviction import install
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout import sglang_internals

    sglang_internals.check_version()
    sglang_internals.hook_scheduler_built(_check_scheduler)
    settings = EngineKVSettings.from_env()
    install(settings, metadata_check.install() if settings.check_attention_metadata else None)
    sglang_internals.hook_sampling_seeds()
    loading_bar.install()
    push_buffers.install()
    _installed = True


def _check_scheduler(resolved: dict) -> None:
    """A scheduler as SGLang resolved it (one token per page, seeded sampling, no overlap, no speculation:
    ``kv.engine_settings.resolved_engine_problem``) or its start fails, naming the setting."""
    from sparse_rl_mega.kv.engine_settings import resolved_engine_problem

    problem = resolved_engine_problem(resolved)
    if problem:
        raise RuntimeError(f"sparse-rl-mega's SGLang plugin cannot run in this scheduler: {problem}")
