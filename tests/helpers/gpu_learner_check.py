"""Run under torchrun (one GPU) by tests/test_gpu.py: the Megatron learner built with Transformer
Engine layers gives the logprobs of the local (pure torch) spec and of transformers, in bfloat16, and
with FP8 (when the GPU supports it) close to them; a report goes to OUT.

    torchrun --nproc-per-node 1 tests/helpers/gpu_learner_check.py MODEL_DIR OUT.txt
"""
import sys

import torch
import torch.distributed as dist


def main() -> None:
    model_dir, out_path = sys.argv[1], sys.argv[2]
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from sparse_rl_mega.batch import RolloutBatch
    from sparse_rl_mega.config import arch_from_hf_config, config_from_dict
    from sparse_rl_mega.learner.cpu_shims import seed_model_parallel_rng
    from sparse_rl_mega.learner.model import build_learner
    from sparse_rl_mega.learner.step import forward_logprobs
    from sparse_rl_mega.learner.weights import load_hf_into_learner

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    ps.initialize_model_parallel(1, 1)
    seed_model_parallel_rng(0)
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = RolloutBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], response_mask=torch.ones(2, 16),
                         logp_sparse=torch.zeros(2, 16), rewards=torch.zeros(2), group_ids=torch.zeros(2, dtype=torch.long))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(hf(ids[:, :-1]).logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]

    def logprobs(impl: str, fp8=None) -> torch.Tensor:
        model = {"path": model_dir, "arch": arch_from_hf_config(model_dir), "dtype": "bfloat16", "transformer_impl": impl}
        if fp8:
            model.update(fp8="hybrid", fp8_recipe=fp8)
        cfg = config_from_dict({"model": model, "parallel": {"nproc_per_node": 1},
                                "rollout": {"n_samples_per_prompt": 2}, "data": {"train_path": "unused.jsonl",
                                "prompts_per_iteration": 1}, "trainer": {"global_batch_size": 2, "micro_batch_size": 2}})
        learner = build_learner(cfg)
        load_hf_into_learner(learner, model_dir, cfg.model.arch)
        return forward_logprobs(learner.chunks, batch, 2).float().cpu()

    lines = []
    local, te = logprobs("local"), logprobs("transformer_engine")
    for name, value in (("local", local), ("transformer_engine", te)):
        gap = float((value - reference).abs().max())
        lines.append(f"bf16 {name} vs transformers fp32: max |dlogp| {gap:.4f}")
        assert gap < 0.15, lines[-1]
    lines.append(f"bf16 transformer_engine vs local: max |dlogp| {float((te - local).abs().max()):.4f}")
    major = torch.cuda.get_device_capability()[0]
    recipe = "mxfp8" if major >= 10 else "delayed" if major >= 9 else None
    if recipe is None:
        lines.append("fp8: skipped (needs Hopper or newer)")
    else:
        # FP8 GEMMs need dimensions divisible by 16; a tiny model's may not be: report, do not fail
        try:
            gap = float((logprobs("transformer_engine", recipe) - reference).abs().max())
            lines.append(f"fp8 ({recipe}) transformer_engine vs transformers fp32: max |dlogp| {gap:.4f}")
        except Exception as exc:  # noqa: BLE001 (a report line, the bf16 checks above are the test)
            lines.append(f"fp8 ({recipe}): not run on this model: {type(exc).__name__}: {exc}")
    open(out_path, "w").write("\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
