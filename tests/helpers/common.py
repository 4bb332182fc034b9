"""Start-up shared by the torchrun helper scripts: CPU shims, gloo, a config for an HF model folder,
Megatron's parallel state at the requested TP/PP."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sparse_rl_mega.learner.cpu_shims import apply_if_cpu, seed_model_parallel_rng

apply_if_cpu()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def start(model_dir: str, tp: int, pp: int, group_size: int, global_batch: int, micro_batch: int,
          algorithm: dict | None = None, parallel: dict | None = None):
    """Initialise this rank and return the validated run config."""
    parallel = parallel or {}
    init_parallel(tp, pp, parallel.get("virtual_pipeline_model_parallel_size", 1),
                  parallel.get("context_parallel_size", 1))
    return run_config(model_dir, tp, pp, group_size, global_batch, micro_batch, algorithm, parallel)


def init_parallel(tp: int, pp: int, vpp: int = 1, cp: int = 1) -> None:
    """gloo process group and Megatron's parallel state (once per process)."""
    init_process_group()
    set_layout(tp, pp, vpp, cp)


def init_process_group() -> None:
    import os

    # one thread per rank as in the suite; OMP_NUM_THREADS=2 checks another reduction split
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if torch.cuda.is_available():  # (the GPU check) as the trainer: NCCL for device tensors, gloo for the rest
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")


def set_layout(tp: int, pp: int, vpp: int = 1, cp: int = 1) -> None:
    """Megatron's parallel state at this layout; an earlier one is torn down first, so that one torchrun
    session can check several layouts."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                 context_parallel_size=cp)
    seed_model_parallel_rng(0)


def run_config(model_dir: str, tp: int, pp: int, group_size: int, global_batch: int, micro_batch: int,
               algorithm: dict | None = None, parallel: dict | None = None):
    """The validated run config for an HF model folder (its arch read from config.json)."""
    from sparse_rl_mega.config import arch_from_hf_config, config_from_dict

    return config_from_dict({
        "model": {"path": model_dir, "arch": arch_from_hf_config(model_dir)},
        "parallel": {"nproc_per_node": dist.get_world_size(), "tensor_model_parallel_size": tp,
                     "pipeline_model_parallel_size": pp, **(parallel or {})},
        "rollout": {"n_samples_per_prompt": group_size, "max_new_tokens": 16},  # (no engine here)
        "data": {"train_path": "unused.jsonl", "prompts_per_iteration": global_batch // group_size},
        "algorithm": algorithm or {},
        "trainer": {"global_batch_size": global_batch, "micro_batch_size": micro_batch}})
