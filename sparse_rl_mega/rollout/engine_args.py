"""An engine's arguments and sizes: the KV settings it starts with, what the KV patch needs beside the
pool (side buffers, the share of memory left for the pool), the sampling support its requests report,
the TP split the KV heads allow, and ``sglang.Engine``'s keyword arguments built from them."""
from __future__ import annotations

import os
from typing import Optional

import torch

from sparse_rl_mega.config.hf import hf_shape
from sparse_rl_mega.kv.engine_settings import (DEFAULT_RUNNING_REQUESTS, EngineKVSettings, cuda_graphs_allowed,
                                               records_queries, side_buffer_bytes, tp_split_problem)
from sparse_rl_mega.kv.registry import build_policy
from sparse_rl_mega.rollout.engine_processes import cpu_core_groups


def newline_token_ids(tokenizer) -> list[int]:
    """Ids of the vocabulary entries whose text ends a line (the newline trigger's tokens)."""
    ids = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text.endswith("\n"):
            ids.append(token_id)
    return ids


def check_request_kv(kv: EngineKVSettings, override: Optional[dict]) -> None:
    """Raise ValueError (TypeError for an unknown policy parameter) if ``override`` (None: the engine's
    own settings) on an engine with settings ``kv`` is not a policy the engine can run at its budget."""
    if override is not None and kv.refusal(override):
        raise ValueError(kv.refusal(override))
    resolved = kv.updated(override) if override is not None else kv
    if resolved.enabled:
        build_policy(resolved.policy, sink=resolved.sink, window=resolved.window, selection=resolved.selection,
                     shared_scores=resolved.shared_scores, **resolved.params).check_budget(resolved.budget)


def engine_kv_settings(kv_cfg, tokenizer=None) -> EngineKVSettings:
    """Map ``rollout.kv_compression`` of the run config onto the engine's settings (the tokenizer is
    needed for the newline trigger)."""
    newlines = []
    if kv_cfg.trigger == "newline":
        if tokenizer is None:
            raise ValueError("the newline trigger needs the tokenizer to find newline tokens")
        newlines = newline_token_ids(tokenizer)
    return EngineKVSettings.from_config(kv_cfg, newline_token_ids=newlines)


def support_cap(top_k: int, vocab_size: int) -> int:
    """The largest sampling support an engine must report for requests truncated at ``top_k`` (-1:
    top-p alone): SGLang's ``sampling_mask_max_tokens``, which also sets how many ids its sampler packs
    per request and step (``layers/sampler.py``), so it is kept as small as the truncation allows."""
    return top_k if top_k > 0 else vocab_size


def check_engine_tp(model_path: str, kv: EngineKVSettings, tp_size: int) -> None:
    """Refuse an engine TP that splits the query heads of a KV head the policy scores
    (:func:`~sparse_rl_mega.kv.engine_settings.tp_split_problem`)."""
    kv_heads = hf_shape(model_path)["kv_heads"]
    problem = tp_split_problem(kv, tp_size, kv_heads)
    if problem:
        raise ValueError(f"engine TP {tp_size} exceeds the {kv_heads} KV heads of {model_path}: {problem}")


def engine_side_buffers(model_path: str, kv: EngineKVSettings, *, tp_size: int, dtype: str,
                        running_requests: int, prompt_tokens: int) -> dict[str, int]:
    """Bytes of the KV patch's side buffers on one engine TP rank of the HF model at ``model_path``
    (``sparse_rl_mega.kv.engine_settings.side_buffer_bytes`` with this model's shape)."""
    shape = hf_shape(model_path)
    return side_buffer_bytes(kv, running_requests=running_requests, layers=shape["layers"],
                             q_heads=shape["heads"] // tp_size, kv_heads=max(1, shape["kv_heads"] // tp_size),
                             head_dim=shape["head_dim"], dtype_bytes=2 if dtype in ("bfloat16", "float16") else 4,
                             prompt_tokens=prompt_tokens)


def reserved_mem_fraction(mem_fraction_static: float, side_bytes: int, free_bytes: int) -> float:
    """``mem_fraction_static`` that leaves ``side_bytes`` more free: SGLang 0.5.23 keeps
    ``free memory at launch x (1 - mem_fraction_static)`` out of its pool (``kv_cache_configurator``:
    ``slack = pre_model_load_memory * (1 - mem_fraction_static)``), so the fraction drops by
    ``side_bytes / free_bytes``."""
    return mem_fraction_static - side_bytes / free_bytes


def gpu_free_bytes(gpu: int) -> int:
    """Free bytes of CUDA device ``gpu`` (an index as this process sees the devices). This rank's own
    GPU: ``cudaMemGetInfo``. Another (a separate engine's): NVML's count, as ``nvidia-smi`` shows it;
    ``torch.cuda.mem_get_info`` there would open a CUDA context (~0.5 GiB) that this process then holds
    on that GPU for its life."""
    if gpu == torch.cuda.current_device():
        return torch.cuda.mem_get_info(gpu)[0]
    import pynvml  # (nvidia-ml-py: a dependency of SGLang and of torch's own NVML queries)

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(gpu))
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)


def server_arguments(model_path: str, kv: EngineKVSettings, *, on_cpu: bool, dtype: str, seed: int, tp_size: int,
                     mem_fraction_static: float, log_level: str, attention_backend: Optional[str], base_gpu_id: int,
                     memory_saver: bool, max_total_tokens: Optional[int], max_running_requests: Optional[int],
                     prompt_tokens: int, sampling_support: Optional[int], log=print) -> dict:
    """``sglang.Engine``'s keyword arguments for an engine with the KV patch (the arguments of
    :class:`~sparse_rl_mega.rollout.engine.RolloutEngine`; ``sampling_support``: the largest sampling
    support it reports, :func:`support_cap`). On a GPU, the patch's side buffers are taken out of
    ``mem_fraction_static`` before SGLang sizes its KV pool, and scoring policies run without CUDA
    graphs (said in one ``[engine]`` line); on a CPU with TP > 1 the TP ranks' OpenMP threads are bound
    to groups of cores (``SGLANG_CPU_OMP_THREADS_BIND``, unless set)."""
    kwargs = dict(model_path=model_path, dtype=dtype, random_seed=seed, tp_size=tp_size, weight_version="0",
                  mem_fraction_static=mem_fraction_static, log_level=log_level, skip_server_warmup=True,
                  # the KV patch edits request rows between steps: one page per token, no overlap
                  page_size=1, disable_overlap_schedule=True,
                  # an idle scheduler otherwise polls at 100 % of a core, which the learner needs
                  sleep_on_idle=True,
                  # the one backend whose kernels take per-request seeds (the seed hook in
                  # sglang_internals.hook_sampling_seeds fills them): on a GPU SGLang would pick flashinfer,
                  # which samples from the global RNG and asserts that no seeds are given
                  sampling_backend="pytorch")
    if on_cpu and tp_size > 1 and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_core_groups(tp_size)
    if on_cpu:
        kwargs.update(device="cpu", attention_backend=attention_backend or "torch_native", disable_cuda_graph=True)
        if attention_backend == "triton":  # its kernels under Triton's interpreter (engine_process_env), which
            # runs a kernel's programs one by one: one KV split (a CPU reports no cores, so SGLang would use
            # its maximum, 8, each a program per request and head group); decode still runs both stages
            kwargs["triton_attention_num_kv_splits"] = 1
    else:
        kwargs.update(base_gpu_id=base_gpu_id, enable_memory_saver=memory_saver)
        if attention_backend:
            kwargs["attention_backend"] = attention_backend
        graphs, why = cuda_graphs_allowed(kv)
        if not graphs:
            kwargs["disable_cuda_graph"] = True
        if records_queries(kv):  # the ring has a row per running request: bound them
            max_running_requests = max_running_requests or DEFAULT_RUNNING_REQUESTS
            side = engine_side_buffers(model_path, kv, tp_size=tp_size, dtype=dtype,
                                       running_requests=max_running_requests, prompt_tokens=prompt_tokens)
            # free memory of the engine's first GPU (colocated GPUs of one node hold the same learner
            # states), read without opening a CUDA context on a GPU that is not this rank's
            free = gpu_free_bytes(base_gpu_id)
            kwargs["mem_fraction_static"] = reserved_mem_fraction(mem_fraction_static, sum(side.values()), free)
            why += (f"; side buffers {sum(side.values()) / 2**30:.2f} GiB per TP rank (query ring "
                    f"{side['query_ring'] / 2**30:.2f}, H2O mass {side['h2o_mass'] / 2**30:.2f}, scoring workspace "
                    f"{side['scoring'] / 2**30:.2f}) taken out of mem_fraction_static -> "
                    f"{kwargs['mem_fraction_static']:.3f}")
        log(f"[engine] {why}")
    if sampling_support is not None:
        kwargs["sampling_mask_max_tokens"] = sampling_support
    if max_total_tokens:
        kwargs["max_total_tokens"] = max_total_tokens
    if max_running_requests:
        kwargs["max_running_requests"] = max_running_requests
    return kwargs
