"""Run under torchrun by tests/test_export_hf.py: the learner's own view of a checkpoint, obtained
without tools/export_hf.py. Builds the whole learner (DDP + optimizer) from the checkpoint's recorded
config at its saved layout, loads the checkpoint with ``load_checkpoint`` (model and optimizer) and
gathers the HF-named weights with ``gather_hf_state_dict``; rank 0 saves them with ``torch.save``.

    torchrun --nproc-per-node N tests/helpers/export_check.py CHECKPOINT_DIR OUT_PT
"""
import argparse
import os

from common import init_parallel  # (first: CPU shims before Megatron)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    args = parser.parse_args()

    from sparse_rl_mega.config import config_from_dict
    from sparse_rl_mega.learner.checkpoint import load_checkpoint, read_marker
    from sparse_rl_mega.learner.model import build_learner
    from sparse_rl_mega.learner.weights import gather_hf_state_dict

    cfg = config_from_dict(read_marker(args.checkpoint)["config"])
    p = cfg.parallel
    if p.nproc_per_node != int(os.environ["WORLD_SIZE"]):
        raise SystemExit(f"start with --nproc-per-node {p.nproc_per_node} (the checkpoint's layout)")
    init_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    learner = build_learner(cfg)
    load_checkpoint(learner, args.checkpoint)
    state = gather_hf_state_dict(learner.modules, cfg.model.arch)
    if dist.get_rank() == 0:
        torch.save(state, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
