"""Run under torchrun by tests/test_learner.py: for each job (a TP/PP layout and HF model folders), load
each model into Megatron at that layout, gather it back, and compute logits, dense logprobs and
entropies through the pipeline schedule, in float64, at temperature 1 and as sampled at temperature 0.6
with one row truncated to a support; rank 0 compares them with transformers computed
wholly in float64 (float_bounds.float64_causal_lm): exactness is the point, and in float32 the
two would differ by however each CPU's kernels round (up to 2.6e-4 on SmolLM2's logprobs on an
AVX-512 machine). The jobs of one torchrun session share its processes (Megatron's parallel state is
re-initialised between layouts); rank 0 writes one JSON object ``{"TPxPP": {model folder name: result}}``.

    torchrun --nproc-per-node N tests/helpers/learner_check.py OUT_JSON JOBS_JSON

JOBS_JSON: a list of ``{"tp", "pp", "models": [MODEL_DIR, ...], "stage_copies", "error_checks"}``
(TP x PP divides N; the rest is data parallelism, each DP rank holding the whole model).

stage_copies (PP > 1): every rank loads from its own copy of the checkpoint that holds only what its
    pipeline stage owns (its layers; the embedding on the first stage; the final norm and output layer
    on the last), which fails if the loader reads anything else.
error_checks (TP1 PP1): loading a checkpoint that lacks a tensor or has one of the wrong shape
    raises an error naming that tensor; the messages are reported.
"""
import json
import re
import sys
from pathlib import Path

from common import init_process_group, run_config, set_layout  # (first: CPU shims before Megatron)
from float_bounds import float64_causal_lm, forward_depth

import torch
import torch.distributed as dist

TEMPERATURE = 0.6
IDS = torch.tensor([[3, 9, 27, 31, 50, 7, 11, 13, 2, 5], [8, 6, 4, 2, 1, 3, 5, 7, 9, 10]])
# a model with RoPE scaling reads 2 x 100 ids: positions up to 98, past its original positions (the tests' 64),
# where every frequency band of the scaling turns its angles far
LONG_IDS = torch.randint(0, 1 << 20, (2, 100), generator=torch.Generator().manual_seed(7))
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _stage_copy(model_dir: Path, out_dir: Path, tied: bool) -> Path:
    """The tensors of ``model_dir`` that this rank's pipeline stage owns, in ``out_dir``."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from sparse_rl_mega.learner.weights import read_hf_state_dict

    state = read_hf_state_dict(model_dir)
    layers = 1 + max(int(LAYER.match(k).group(1)) for k in state if LAYER.match(k))
    per_stage = layers // ps.get_pipeline_model_parallel_world_size()
    first = ps.get_pipeline_model_parallel_rank() * per_stage
    wanted = set()
    if ps.is_pipeline_first_stage() or (tied and ps.is_pipeline_last_stage()):
        wanted.add("model.embed_tokens.weight")
    if ps.is_pipeline_last_stage():
        wanted |= {"model.norm.weight", "lm_head.weight"}
    kept = {k: v for k, v in state.items()
            if k in wanted or (LAYER.match(k) and first <= int(LAYER.match(k).group(1)) < first + per_stage)}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(out_dir / "model.safetensors"))
    return out_dir


def _error_messages(module, model_dir: Path, arch, work: Path) -> dict:
    """Load two broken copies of ``model_dir``; return the error each raised."""
    from safetensors.torch import save_file

    from sparse_rl_mega.learner.weights import load_hf_into_model, read_hf_state_dict

    state = read_hf_state_dict(model_dir)
    missing = dict(state)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    bad_shape = dict(state)
    bad_shape["model.layers.0.mlp.up_proj.weight"] = bad_shape["model.layers.0.mlp.up_proj.weight"][:-1]
    out = {}
    for name, broken in (("missing", missing), ("shape", bad_shape)):
        folder = work / f"broken-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(broken, str(folder / "model.safetensors"))
        try:
            load_hf_into_model(module, folder, arch)
            out[name] = None
        except (KeyError, ValueError) as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


@torch.no_grad()
def _logits_and_entropy(model, batch):
    """Full-vocabulary logits [b, s, V] (TP-gathered) and entropies [b, s] (vocab-parallel) through
    Megatron's pipeline schedule, on the last stage's ranks (None elsewhere); the entropies are those of
    the distribution ``batch`` was sampled from (its temperature and supports)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from sparse_rl_mega.learner.vocab_parallel import logprobs_and_entropy

    b, s = batch.input_ids.shape

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        output = chunk(mb["input_ids"], torch.arange(s).unsqueeze(0).expand(b, -1), None)

        def collect(logits):
            _, entropy = logprobs_and_entropy(logits, mb["labels"], temperature=batch.temperature,
                                              support_ids=batch.padded_supports(slice(None)))
            return logits.sum() * 0.0, torch.tensor(1, dtype=torch.int), {
                "logits": gather_from_tensor_model_parallel_region(logits), "entropy": entropy}
        return output, collect

    model.eval()
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([{"input_ids": batch.input_ids, "labels": batch.labels}]),
        model=[model], num_microbatches=1, seq_length=s, micro_batch_size=b, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None, None
    return results[0]["logits"], results[0]["entropy"]


def _pack_every_bucket(modules, model_dir: Path, arch) -> tuple[list[str], bool]:
    """Plan a push in float32 buckets of 64 KiB (several per rank), pack each bucket on its owner (the
    other TP ranks sending their pieces), and compare every packed tensor with the HF file's, read on
    the owner (collective): ``(every name packed, all of them bit for bit)``."""
    from sparse_rl_mega.learner.flat_buckets import holds_pieces, pack_bucket, plan_push, send_pieces
    from sparse_rl_mega.learner.weights import _LazyHFCheckpoint, _local_shards

    shards = _local_shards(modules, main_replica_only=True)
    plan = plan_push(shards, arch, torch.float32, 64 * 1024)
    checkpoint = _LazyHFCheckpoint(model_dir)
    exact = True
    for bucket in plan.buckets:
        if bucket.owner == dist.get_rank():
            flat = torch.full((bucket.nbytes + 7,), 0xFF, dtype=torch.uint8)  # (a byte left unwritten shows)
            pack_bucket(plan, bucket, flat, shards, arch)
            for slot in bucket.slots:
                packed = flat[slot.offset:slot.offset + slot.nbytes].view(torch.float32).view(slot.shape)
                exact &= torch.equal(packed, checkpoint.read(slot.name))
        elif holds_pieces(bucket, dist.get_rank()):
            send_pieces(bucket, shards)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, exact)
    names = [slot.name for bucket in plan.buckets for slot in bucket.slots]
    return names, all(everyone)


def check_model(model_dir: Path, tp: int, pp: int, work: Path, stage_copies: bool, error_checks: bool) -> dict:
    from megatron.core import parallel_state as ps

    from sparse_rl_mega.batch import RolloutBatch
    from sparse_rl_mega.learner.model import build_learner
    from sparse_rl_mega.learner.step import forward_logprobs
    from sparse_rl_mega.learner.weights import gather_hf_state_dict, load_hf_into_model, read_hf_state_dict

    cfg = run_config(str(model_dir), tp, pp, group_size=2, global_batch=4, micro_batch=1)  # DP2 at TP1 PP1
    cfg.model.dtype = "float64"  # (the HF float32 weights are widened exactly)
    arch = cfg.model.arch
    learner = build_learner(cfg)
    errors = _error_messages(learner.modules, model_dir, arch, work / model_dir.name) if error_checks else None
    source = model_dir
    if stage_copies and pp > 1:
        source = _stage_copy(model_dir, work / f"rank{dist.get_rank()}" / model_dir.name, arch.tie_word_embeddings)
    load_hf_into_model(learner.modules, source, arch)
    gathered = gather_hf_state_dict(learner.modules, arch)
    packed_names, packed_exact = _pack_every_bucket(learner.modules, model_dir, arch)

    ids = (IDS if arch.rope_scaling is None else LONG_IDS) % arch.vocab_size
    n = ids.shape[1] - 1
    batch = RolloutBatch(input_ids=ids[:, :-1], labels=ids[:, 1:], response_mask=torch.ones(2, n),
                         logp_sparse=torch.zeros(2, n), rewards=torch.zeros(2), group_ids=torch.zeros(2, dtype=torch.long))
    logp = forward_logprobs(learner.chunks, batch, micro_batch_size=1)
    logits, entropy = _logits_and_entropy(learner.chunks[0], batch)
    # sampled at temperature 0.6, row 1 truncated to its label and 5 ids spread unevenly over the vocabulary
    # (every TP rank's slice); row 0 keeps the whole vocabulary
    sampled = batch.select([0, 1])
    sampled.temperature = TEMPERATURE
    support = torch.stack([(batch.labels[1] + k * (arch.vocab_size // 7)) % arch.vocab_size for k in range(6)], 1)
    sampled.support_counts = torch.tensor([[0] * n, [6] * n], dtype=torch.int32)
    sampled.support_ids = [torch.zeros(0, dtype=torch.int32), support.reshape(-1).to(torch.int32)]
    sampled_logp = forward_logprobs(learner.chunks, sampled, micro_batch_size=1)
    _, sampled_entropy = _logits_and_entropy(learner.chunks[0], sampled)
    if pp > 1:  # the last stage's results to the first (rank 0 is on the first stage)
        if logits is None:
            logits = torch.empty(*ids[:, 1:].shape, arch.vocab_size, dtype=torch.float64)
            entropy = torch.empty(ids[:, 1:].shape, dtype=torch.float64)
            sampled_entropy = torch.empty(ids[:, 1:].shape, dtype=torch.float64)
        for tensor in (logits, entropy, sampled_entropy):
            dist.broadcast(tensor, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
    result = None
    if dist.get_rank() == 0:
        original = read_hf_state_dict(model_dir)
        hf = float64_causal_lm(model_dir)
        with torch.no_grad():
            ref_logits = hf(ids[:, :-1]).logits
        ref_all = torch.log_softmax(ref_logits, -1)
        ref = ref_all.gather(-1, ids[:, 1:, None])[..., 0]
        ref_entropy = -(ref_all.exp() * ref_all).sum(-1)
        # the sampled distribution, from transformers' logits: divided by the temperature, -inf off the support
        scaled = ref_logits / TEMPERATURE
        off_support = torch.ones_like(scaled, dtype=torch.bool)
        off_support[0] = False
        off_support[1].scatter_(-1, support, False)
        ref_sampled_all = torch.log_softmax(scaled.masked_fill(off_support, float("-inf")), -1)
        ref_sampled = ref_sampled_all.gather(-1, ids[:, 1:, None])[..., 0]
        ref_sampled_entropy = -(ref_sampled_all.exp() * ref_sampled_all.masked_fill(off_support, 0.0)).sum(-1)
        result = {
            "family": arch.family, "tied": arch.tie_word_embeddings, "head_dim": arch.kv_channels,
            "rope_scaling": arch.rope_scaling and vars(arch.rope_scaling), "positions": n,
            "qkv_bias": arch.has_qkv_bias, "qk_layernorm": arch.qk_layernorm,
            "same_names": sorted(gathered) == sorted(original),
            # float32 weights in a float64 model: gathered back and narrowed, they must be the very same
            "bit_exact": all(torch.equal(gathered[k].to(original[k].dtype), original[k]) for k in original if k in gathered),
            # the weight push's flattened buckets, packed by their owners: every HF tensor once, exactly
            "packed": {"names": sorted(packed_names) == sorted(original), "exact": packed_exact},
            "learner_dtype": str(logp.dtype),
            "depth": forward_depth(arch.num_layers, arch.hidden_size, arch.ffn_hidden_size, arch.kv_channels,
                                   ids.shape[1] - 1, arch.vocab_size),
            "max_abs_logit": float(ref_logits.abs().max()),
            "max_abs_logit_diff": float((logits - ref_logits).abs().max()),
            "max_abs_logprob_diff": float((logp - ref).abs().max()),
            "max_abs_entropy_diff": float((entropy - ref_entropy).abs().max()),
            "temperature": TEMPERATURE,
            "max_abs_sampled_logprob_diff": float((sampled_logp - ref_sampled).abs().max()),
            "max_abs_sampled_entropy_diff": float((sampled_entropy - ref_sampled_entropy).abs().max()),
            "truncated_entropy_mean": float(ref_sampled_entropy[1].mean()),
            "entropy_mean": float(entropy.mean()),
            "errors": errors,
        }
    del learner
    dist.barrier()
    return result


def main() -> None:
    out, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    init_process_group()
    results = {}
    for job in jobs:
        tp, pp = job["tp"], job["pp"]
        set_layout(tp, pp)
        work = out.parent / f"learner_check_{tp}x{pp}"
        results[f"{tp}x{pp}"] = {Path(model).name: check_model(Path(model), tp, pp, work, job.get("stage_copies", False),
                                                                job.get("error_checks", False))
                                 for model in job["models"]}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
