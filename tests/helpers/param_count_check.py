"""Run under torchrun by tests/test_planner.py: build the real Megatron GPTModel chunk of every rank at
the given TP/PP for each architecture in ARCHS_JSON (no weights loaded, no initialisation) and count its
parameters; rank 0 writes ``{name: [[tp_rank, pp_rank, count], ...]}`` to OUT_JSON.

    torchrun --nproc-per-node TP*PP tests/helpers/param_count_check.py TP PP ARCHS_JSON OUT_JSON
"""
import argparse
import json
from pathlib import Path

from common import init_parallel  # (first: CPU shims before Megatron)

import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tp", type=int)
    parser.add_argument("pp", type=int)
    parser.add_argument("archs")
    parser.add_argument("out")
    args = parser.parse_args()
    init_parallel(args.tp, args.pp)
    from megatron.core import parallel_state as ps

    from sparse_rl_mega.config import config_from_dict
    from sparse_rl_mega.learner.model import build_model

    results = {}
    for name, arch in json.loads(Path(args.archs).read_text()).items():
        cfg = config_from_dict({
            "model": {"path": "unused-model-folder", "arch": arch},
            "parallel": {"nproc_per_node": dist.get_world_size(), "tensor_model_parallel_size": args.tp,
                         "pipeline_model_parallel_size": args.pp},
            "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 16},
            "data": {"train_path": "unused.jsonl", "prompts_per_iteration": 2},
            "trainer": {"global_batch_size": 4, "micro_batch_size": 1}})
        model = build_model(cfg, initialize=False)
        count = sum(p.numel() for chunk in model for p in chunk.parameters())
        row = [ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), count]
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        results[name] = rows
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
