"""Run under torchrun (one GPU) by tests/test_gpu.py: the Megatron learner's logprobs with the local
(pure torch) spec and with Transformer Engine layers, against transformers in float32 and against each
other, in float32 and bfloat16, and with FP8 where the GPU supports it. Every comparison is a check
against a stated bound. Without Transformer Engine the local spec's checks run and the others are
``SKIP`` lines naming why. The report goes to OUT, one ``PASS|FAIL|SKIP name: detail`` line per check
(``INFO`` lines: the bounds used), ``END`` when every part ran; it is written even when a check fails
or something raises. Exit status 1 when a check failed.

    torchrun --nproc-per-node 1 tests/helpers/gpu_learner_check.py MODEL_DIR OUT.txt
"""
import copy
import importlib.util
import sys
import traceback

import torch
import torch.distributed as dist

# Sizes measured on the tiny test model (4 layers, hidden 64) and these 32 random tokens, max / mean
# |dlogp| against transformers float32: transformers in bfloat16 0.036 / 0.008 (CPU), Megatron's local
# spec in bfloat16 0.026 / 0.007 (CPU), and the two bfloat16 forwards 0.044 / 0.009 apart; the bugs of
# BUGS move them by 0.23 / 0.036 (norm weights left at init), 0.73 / 0.062 (q/k rotary layout) and
# 3.0-4.6 / 0.5-2.4 (swapped weights, missing norm).
#
# float32: the local spec matches transformers to 2e-6; Transformer Engine may run float32 GEMMs in
# TF32, whose mantissa is 8x finer than bfloat16's (so ~0.036 / 8 = 0.005 here). 0.02 leaves 4x that
# and stays 10x under the subtlest bug.
FP32_MAX = 0.02
# bfloat16: Megatron rounds at about the places transformers' bfloat16 forward does, so the bound is
# twice transformers' own bfloat16 error on this GPU (floored, so a lucky small error is no bound). The
# same bound holds Transformer Engine against the local spec: two bfloat16 forwards of the same math
# are as far apart as each is from float32 (the tight same-math comparison is the float32 one). BUGS
# checks on every run that the bound still catches a real mistake on this model.
BF16_FLOOR_MAX, BF16_FLOOR_MEAN = 0.05, 0.015
# FP8 against bfloat16 (same layers): e4m3 keeps 4 significant bits to bfloat16's 8 (16x coarser).
# Quantizing this model's block GEMMs in simulation (per tensor, and in 32-blocks with power-of-two
# scales as MXFP8 does) moves logprobs by 0.11-0.21 / 0.024-0.030; the bounds leave 2.5-4x that.
FP8_MAX, FP8_MEAN = 0.5, 0.1
BUGS = ("wrong weight map (layer 0/1 MLP down projections swapped)", "missing input RMSNorm",
        "input RMSNorm weights not loaded (left at 1)", "q/k rows in the other rotary layout")


def gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Max and mean |a - b| (NaN when either has a NaN: every bound check then fails)."""
    d = (a.float() - b.float()).abs()
    return float(d.max()), float(d.mean())


def broken(hf, bug: str):
    """A copy of transformers' model with one mistake a weight map or layer spec could make."""
    model = copy.deepcopy(hf)
    layers, config = model.model.layers, model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if bug == BUGS[0]:
        a, b = layers[0].mlp.down_proj.weight, layers[1].mlp.down_proj.weight
        a.data, b.data = b.data.clone(), a.data.clone()
    for layer in layers:
        if bug == BUGS[1]:
            layer.input_layernorm = torch.nn.Identity()
        elif bug == BUGS[2]:
            layer.input_layernorm.weight.data.fill_(1.0)
        elif bug == BUGS[3]:  # each head's rotary halves as interleaved pairs: the q/k permutation slip
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = proj.weight.data
                proj.weight.data = w.view(-1, 2, head_dim // 2, w.shape[1]).transpose(1, 2).reshape_as(w).contiguous()
    return model


def fp8_recipe() -> tuple:
    """(recipe, "") for this GPU (MXFP8 on Blackwell, delayed scaling before), or (None, why not)."""
    import transformer_engine.pytorch as te

    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        return None, f"compute capability {capability[0]}.{capability[1]} (FP8 needs 8.9 or newer)"

    def available(kind: str) -> tuple:  # newer TE exports is_*_available; older 2.x has them here
        check = getattr(te, f"is_{kind}_available", None)
        if check is not None:
            return tuple(check(return_reason=True))
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

        return tuple(getattr(FP8GlobalStateManager, f"is_{kind}_available")())

    ok, reason = available("fp8")
    if not ok:
        return None, f"Transformer Engine: {reason}"
    if capability >= (10, 0) and available("mxfp8")[0]:
        return "mxfp8", ""
    return "delayed", ""


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

    def hf_logprobs(model, device="cpu") -> torch.Tensor:
        with torch.no_grad():
            logits = model(ids[:, :-1].to(device)).logits.float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None].to(device))[..., 0].cpu()

    def learner_logprobs(impl: str, dtype: str, fp8=None) -> torch.Tensor:
        model = {"path": model_dir, "arch": arch_from_hf_config(model_dir), "dtype": dtype, "transformer_impl": impl}
        if fp8:
            model.update(fp8="hybrid", fp8_recipe=fp8)
        cfg = config_from_dict({"model": model, "parallel": {"nproc_per_node": 1},
                                "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 16}, "data": {"train_path": "unused.jsonl",
                                "prompts_per_iteration": 1}, "trainer": {"global_batch_size": 2, "micro_batch_size": 2}})
        learner = build_learner(cfg)
        load_hf_into_learner(learner, model_dir, cfg.model.arch)
        # delayed scaling quantizes with the amax of the previous pass (none before the first): the first
        # pass calibrates, the second is the one compared
        for _ in range(2 if fp8 else 1):
            logp = forward_logprobs(learner.chunks, batch, 2).float()
        return logp

    lines = []

    def check(name: str, ok: bool, detail: str) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
        print(lines[-1], flush=True)

    def within(name: str, value: tuple, bound: tuple) -> None:
        check(name, value[0] <= bound[0] and value[1] <= bound[1],
              f"max |dlogp| {value[0]:.4f} (bound {bound[0]:.4f}), mean {value[1]:.4f} (bound {bound[1]:.4f})")

    try:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        reference = hf_logprobs(hf)
        noise = gap(hf_logprobs(copy.deepcopy(hf).to("cuda", torch.bfloat16), "cuda"), reference)
        bf16 = (max(2 * noise[0], BF16_FLOOR_MAX), max(2 * noise[1], BF16_FLOOR_MEAN))
        lines.append(f"INFO bf16 bound: max {bf16[0]:.4f}, mean {bf16[1]:.4f} (transformers bf16 on this GPU: "
                     f"{noise[0]:.4f}, {noise[1]:.4f})")
        print(lines[-1], flush=True)
        for bug in BUGS:
            value = gap(hf_logprobs(broken(hf, bug)), reference)
            check(f"bf16 bound catches {bug}", value[0] > bf16[0] or value[1] > bf16[1],
                  f"max |dlogp| {value[0]:.4f}, mean {value[1]:.4f}")

        fp32 = (FP32_MAX, FP32_MAX)
        local32 = learner_logprobs("local", "float32")
        within("fp32 local vs transformers fp32", gap(local32, reference), fp32)
        local16 = learner_logprobs("local", "bfloat16")
        within("bf16 local vs transformers fp32", gap(local16, reference), bf16)
        if importlib.util.find_spec("transformer_engine") is None:
            lines.extend(f"SKIP {name}: Transformer Engine is not installed"
                         for name in ("fp32 transformer_engine", "bf16 transformer_engine", "fp8"))
        else:
            te32 = learner_logprobs("transformer_engine", "float32")
            within("fp32 transformer_engine vs transformers fp32", gap(te32, reference), fp32)
            within("fp32 transformer_engine vs local", gap(te32, local32), fp32)
            te16 = learner_logprobs("transformer_engine", "bfloat16")
            within("bf16 transformer_engine vs transformers fp32", gap(te16, reference), bf16)
            within("bf16 transformer_engine vs local", gap(te16, local16), bf16)

            # a failure in the FP8 part fails its checks only (the report says which), never passed over
            recipe = None
            try:
                recipe, reason = fp8_recipe()
                fp8 = None if recipe is None else learner_logprobs("transformer_engine", "bfloat16", recipe)
            except Exception as exc:  # noqa: BLE001 (a FAIL line, with the traceback on stderr)
                traceback.print_exc()
                check("fp8 run", False, f"recipe {recipe}: {type(exc).__name__}: {exc}")
            else:
                if fp8 is None:
                    lines.append(f"SKIP fp8: {reason}")
                    print(lines[-1], flush=True)
                else:
                    bad = int((~torch.isfinite(fp8)).sum())
                    check(f"fp8 ({recipe}) finite", bad == 0, f"{bad} non-finite logprobs")
                    value = gap(fp8, te16)
                    check(f"fp8 ({recipe}) applied", value[0] > 0, "differs from bf16 (else FP8 was not in effect)")
                    within(f"fp8 ({recipe}) vs bf16 transformer_engine", value, (FP8_MAX, FP8_MEAN))
        lines.append("END")
    finally:
        with open(out_path, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()
    sys.exit(1 if any(line.startswith("FAIL") for line in lines) else 0)


if __name__ == "__main__":
    main()
