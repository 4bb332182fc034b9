"""The memory planner (sparse_rl_mega/cli/planner.py, ``tools/launch.py CONFIG --plan``) against real models.

* parameters: the planner's whole-model count equals transformers' for every family (tiny random
  configs and the 70B example's shape, built on the meta device); each rank's shard at TP2 x PP2
  equals the parameters of the real Megatron GPTModel chunk of that rank (one torchrun launch);
  TP shards add up to the whole layer; KV heads per engine rank follow SGLang's own rule;
* KV: one real SGLang engine on CPU: its KV pool's K/V buffers hold exactly the planner's bytes per
  token x their rows, and the pool has ``rollout.max_total_tokens`` slots as planned;
* CLI: ``--plan`` works for every example in examples/ and says "does NOT fit" (exit 3) for 70B on
  one 80 GiB GPU.
"""
import json

import torch

import pytest

from sparse_rl_mega.config import ArchConfig, config_from_dict, load_config
from sparse_rl_mega.cli.planner import (GIB, engine_kv_heads, engine_memory, engine_params, layer_params, plan_memory,
                                    request_kv_tokens, stage_params, total_params)
from tests.conftest import ROOT, TRAIN_DATA, run_launch, run_torchrun

TINY = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
            vocab_size=96, max_position_embeddings=128)
FAMILIES = {
    "llama": dict(family="llama"),
    "llama-tied": dict(family="llama", tie_word_embeddings=True),
    "qwen2-bias": dict(family="qwen2"),
    "qwen3-qknorm-tied": dict(family="qwen3", head_dim=24, tie_word_embeddings=True),
}
EXAMPLE_70B = ROOT / "examples" / "70b_math.yaml"
# the 70B example on 8 GPUs per node with colocated TP 8 engines (its layout before overlapped rollouts):
# the arithmetic below is written for that layout
COLOCATED_TP8 = ["parallel.nproc_per_node=8", "parallel.tensor_model_parallel_size=8",
                 "parallel.pipeline_model_parallel_size=4", "rollout.engine_tensor_parallel_size=8",
                 "rollout.placement=colocated", "rollout.mem_fraction_static=0.7", "rollout.max_staleness=0"]


def _hf_param_count(arch: ArchConfig) -> int:
    """transformers' parameter count of this architecture (built on the meta device: no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from sparse_rl_mega.models.tiny import hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(arch, eos_id=0))
    return sum(p.numel() for p in model.parameters())  # a tied weight is listed once


@pytest.mark.parametrize("name", list(FAMILIES))
def test_total_params_match_transformers(name):
    arch = ArchConfig(**TINY, **FAMILIES[name])
    assert total_params(arch) == _hf_param_count(arch)
    assert engine_params(arch, 1) == total_params(arch)


def test_70b_total_params_match_transformers():
    arch = load_config(EXAMPLE_70B).model.arch
    assert total_params(arch) == _hf_param_count(arch) == 70_553_706_496  # Llama-3.1-70B


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_shards_add_up_to_the_layer(tp):
    """Every TP rank holds 1/tp of each matrix and bias and a full copy of the norms."""
    arch = load_config(EXAMPLE_70B).model.arch
    qwen3 = ArchConfig(**{**TINY, "num_attention_heads": 8, "num_query_groups": 8}, family="qwen3", head_dim=24)
    qwen2 = ArchConfig(**{**TINY, "num_attention_heads": 8, "num_query_groups": 8}, family="qwen2")
    for a in (arch, qwen3, qwen2):
        replicated = 2 * a.hidden_size + (2 * a.kv_channels if a.qk_layernorm else 0)
        assert tp * layer_params(a, tp) == layer_params(a, 1) + (tp - 1) * replicated
        # pipeline stages partition the layers; the embedding lives on the first stage, the output layer on the last
        assert sum(stage_params(a, 1, 4, s) for s in range(4)) == total_params(a)


def test_megatron_rank_shards_match(tmp_path):
    """One torchrun launch at TP2 x PP2: every rank's real GPTModel chunk, every family."""
    archs = {name: {**TINY, **keys} for name, keys in FAMILIES.items()}
    (tmp_path / "archs.json").write_text(json.dumps(archs))
    out = tmp_path / "counts.json"
    proc = run_torchrun(ROOT / "tests" / "helpers" / "param_count_check.py", 2, 2, tmp_path / "archs.json", out,
                        nproc=4, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(out.read_text())
    for name, keys in archs.items():
        arch = ArchConfig(**keys)
        assert len(counts[name]) == 4
        for tp_rank, pp_rank, count in counts[name]:
            assert count == stage_params(arch, 2, 2, pp_rank), (name, tp_rank, pp_rank)


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_engine_kv_heads_follow_sglang(groups):
    """KV heads per engine rank: SGLang's own rule (split over TP, one replicated head per rank past
    the group count)."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig

    arch = ArchConfig(**{**TINY, "num_attention_heads": 16, "num_query_groups": groups})
    stub = SimpleNamespace(get_total_num_kv_heads=lambda: groups, is_draft_model=False)
    for tp in (1, 2, 4, 8, 16):
        assert engine_kv_heads(arch, tp) == ModelConfig.get_num_kv_heads(stub, tp), tp


# ----------------------------------------------------------------------------- the real engine's KV pool

POOL_TOKENS = 3000


def _tiny_run_config(model_dir, arch: ArchConfig, **rollout):
    return config_from_dict({
        "model": {"path": str(model_dir), "arch": {k: getattr(arch, k) for k in TINY}},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 24, **rollout},
        "data": {"train_path": str(TRAIN_DATA), "prompts_per_iteration": 2},
        "trainer": {"global_batch_size": 8, "micro_batch_size": 1}})


# the paper's release settings (shared set from the first layer, no sinks), no per-request overrides
RELEASE_KV = dict(policy="rkv", budget=12, sink=0, window=4, interval=2, selection="shared")


@pytest.fixture(scope="module")
def pool_engine(tiny_model_dir):
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.rollout.engine import RolloutEngine

    engine = RolloutEngine(str(tiny_model_dir), EngineKVSettings(**RELEASE_KV), max_total_tokens=POOL_TOKENS, max_running_requests=8)
    yield engine
    engine.shutdown()


def test_kv_bytes_match_the_engines_pool(pool_engine, tiny_model_dir, tiny_arch):
    state = pool_engine.internal_state()
    allocated = state["sparse_rl_kv"]
    cfg = _tiny_run_config(tiny_model_dir, tiny_arch, max_total_tokens=POOL_TOKENS,
                           kv_compression={"policy": "rkv", "budget": 12, "sink": 2, "window": 4, "interval": 2})
    em = engine_memory(cfg, 80 * GIB, prompt_tokens=10)
    # 2 (K, V) x 4 layers x 2 KV heads x 16 head width x 4 bytes (float32)
    assert em.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4
    assert em.pool_tokens == state["memory_usage"]["token_capacity"] == POOL_TOKENS
    # SGLang's buffers: one row per slot plus its padding page (page_size 1), K and V for every layer
    assert allocated["kv_pool_rows"] == POOL_TOKENS + 1
    assert allocated["kv_pool_bytes"] == em.kv_bytes_per_token * allocated["kv_pool_rows"]
    assert abs(state["memory_usage"]["kvcache"] - allocated["kv_pool_bytes"] / GIB) < 1e-3  # SGLang's GB figure
    # the admission rule: prompt + min(max_new, budget + interval + 1) slots compressed, prompt + max_new dense
    assert request_kv_tokens(cfg, 10) == (10 + 24, 10 + 12 + 2 + 1)
    assert (em.dense_concurrent, em.sparse_concurrent) == (POOL_TOKENS // 34, POOL_TOKENS // 25)


def test_release_settings_record_one_layer_and_match_the_reference(pool_engine, hf_model):
    """An engine started with the release's settings (no per-request overrides) records the first
    layer's queries only, which is all its shared choice reads: its ring is a quarter of a 4-layer one,
    as --plan counts it, and its samples equal the reference decoder's."""
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings, side_buffer_bytes
    from sparse_rl_mega.kv import build_policy
    from sparse_rl_mega.kv.reference_decoder import ReferenceDecoder

    samples = pool_engine.generate([[5, 17, 42, 99, 100, 7, 8, 9]], n_samples=3, max_new_tokens=24, seed=2,
                                   ignore_eos=True)
    ring = side_buffer_bytes(EngineKVSettings(**RELEASE_KV), running_requests=8, layers=4, q_heads=4, kv_heads=2,
                             head_dim=16, dtype_bytes=4, prompt_tokens=8)["query_ring"]
    assert pool_engine.kv_stats()["query_ring_bytes"] == ring == (8 + 1) * 1 * 4 * 4 * 16 * 4
    policy = build_policy("rkv", sink=0, window=4, selection="shared")
    ref = ReferenceDecoder(hf_model)
    for s in samples:
        logp, evicted = ref.logprobs(s.prompt_ids, s.response_ids, policy, 12, 2)
        assert evicted > 0 and len(logp) == len(s.logp_sparse)
        assert max(abs(a - b) for a, b in zip(logp, s.logp_sparse)) < 1e-4


# ----------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_plan_every_example(example):
    proc = run_launch(example, "--plan", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for expected in ("memory plan:", "learner    rank of stage", "KV per token", "activations", "verdict    fits"):
        assert expected in proc.stdout, expected


def test_70b_side_buffers_are_planned_and_fit_beside_the_pool():
    """The KV patch's query ring (and H2O's mass) for the 70B example's model with colocated engines: 80
    layers, 64 / 8 heads of 128 at engine TP 8 (8 query heads and 1 KV head per rank), bfloat16, window 8, 128 running requests;
    --plan shows them and takes them out of mem_fraction_static before the pool."""
    ring = (128 + 1) * 80 * 8 * 8 * 128 * 2  # [running + SGLang's padding row, layers, window, q_heads, d]
    mass = 128 * 80 * 1 * (512 + 512 + 128 + 1 + 64) * 4  # float32 per running request: prompt + B + N + 1 + headroom
    # scoring one 641-token request: R-KV's similarities (4 + 1 + 1 bytes per key pair, 80 layers), the keys
    # (bf16 + two float32 copies), K and V gathered and kept; as many per chunk as fit in 256 MiB (at least 1)
    keys_and_copies = 80 * 641 * 128 * (2 + 8) + 2 * 80 * (641 + 512) * 128 * 2
    rkv_scoring = 80 * 641 * 641 * 6 + keys_and_copies  # > 256 MiB: one request at a time
    h2o_scoring = 2 * keys_and_copies  # two requests per chunk
    for policy, expected in (("rkv", {"query_ring": ring, "h2o_mass": 0, "scoring": rkv_scoring}),
                             ("h2o", {"query_ring": ring, "h2o_mass": mass, "scoring": h2o_scoring})):
        plan = plan_memory(load_config(EXAMPLE_70B, COLOCATED_TP8 + [f"rollout.kv_compression.policy={policy}"]),
                           80, 512)
        em = plan.engine
        assert em.side_buffers == expected
        assert em.static_bytes == int(em.free_bytes * 0.7) - sum(expected.values())
        assert em.weight_bytes + em.pool_bytes + em.side_bytes <= em.free_bytes * 0.7
        assert plan.fits
    shared = plan_memory(load_config(EXAMPLE_70B, COLOCATED_TP8 + ["rollout.kv_compression.selection=shared"]),
                         80, 512).engine
    assert shared.side_buffers["query_ring"] == ring // 80  # the first layer's queries only
    proc = run_launch(EXAMPLE_70B, "--plan", *[f"--set={o}" for o in COLOCATED_TP8], timeout=120)
    side = ring + rkv_scoring
    assert (f"side buffers {side / GIB:9.2f} GiB  (query ring {ring / GIB:.2f} GiB for 128 running requests, "
            f"scoring workspace {rkv_scoring / GIB:.2f} GiB") in proc.stdout
    assert "CUDA graphs off" in proc.stdout


def test_side_buffers_widen_what_sglang_leaves_free():
    """The engine lowers mem_fraction_static so that SGLang 0.5.23's pool (kv_cache_configurator:
    rest = available - pre_model_load_memory x (1 - mem_fraction_static)) shrinks by the side buffers."""
    from sparse_rl_mega.rollout.engine_args import reserved_mem_fraction

    free, side, available = 60 * GIB, 3 * GIB, 40 * GIB
    rest = lambda fraction: available - free * (1 - fraction)  # noqa: E731
    assert abs(rest(0.7) - rest(reserved_mem_fraction(0.7, side, free)) - side) < 1


def test_plan_says_an_impossible_layout_does_not_fit():
    """70B at TP 1 x PP 1: the learner alone needs several GPUs' memory; exit 3."""
    proc = run_launch(EXAMPLE_70B, "--plan", "--set", "parallel.nnodes=1", "--set",
                      "parallel.tensor_model_parallel_size=1", "--set", "parallel.pipeline_model_parallel_size=1",
                      "--set", "parallel.virtual_pipeline_model_parallel_size=1",
                      "--set", "parallel.sequence_parallel=false", "--set", "rollout.num_engines=1", timeout=120)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "does NOT fit: learner (stage 0) needs" in proc.stdout
    # a separate engine at TP 1: the bfloat16 weights (131 GiB) exceed 0.85 x 80 GiB
    cfg = load_config(EXAMPLE_70B, ["rollout.engine_tensor_parallel_size=1", "rollout.placement=separate",
                                    "trainer.sync_method=broadcast"])
    plan = plan_memory(cfg, 80.0)
    assert not plan.fits and any(p.startswith("engine weights") for p in plan.problems)
    assert plan.engine.weight_bytes == 2 * total_params(cfg.model.arch)



def test_recomputation_lowers_the_activation_estimate():
    """Selective recomputation keeps no attention scores; full keeps only each layer's input."""
    from sparse_rl_mega.cli.planner import learner_memory

    def stage0(mode):
        cfg = load_config(EXAMPLE_70B, ["model.transformer_impl=local", "parallel.sequence_parallel=false",
                                        "model.fp8=null", f"parallel.recompute={mode}"])
        return learner_memory(cfg, 512, 0).activation_bytes

    assert stage0("full") < stage0("selective") < stage0("none")


def test_interleaving_and_context_parallelism_in_the_activation_estimate():
    """Virtual stages: the first stage holds (pp - 1) * 2 + (vpp - 1) * pp + 1 chunk passes of
    layers / vpp layers, 1 + (pp - 1) / (pp * vpp) times the 1F1B activations (Narayanan et al. 2021).
    Context parallelism: with fused attention a rank stores activations of its share of the tokens."""
    from sparse_rl_mega.cli.planner import learner_memory

    plain = COLOCATED_TP8 + ["parallel.virtual_pipeline_model_parallel_size=1"]
    base = learner_memory(load_config(EXAMPLE_70B, plain), 512, 0)
    interleaved = learner_memory(load_config(EXAMPLE_70B, COLOCATED_TP8 + ["parallel.virtual_pipeline_model_parallel_size=5"]),
                                 512, 0)
    assert interleaved.activation_bytes / base.activation_bytes == pytest.approx(1 + 3 / 20)
    assert interleaved.micro_batches_in_flight == pytest.approx(4.6)
    split = learner_memory(load_config(EXAMPLE_70B, plain + ["parallel.context_parallel_size=2"]), 512, 0)
    assert split.activation_bytes == pytest.approx(base.activation_bytes / 2, rel=1e-6)
    assert split.param_bytes == base.param_bytes


def test_optimizer_state_exists_before_a_colocated_engine_is_sized(monkeypatch):
    """The planner counts Adam's moments as resident when a colocated engine starts: the trainer
    allocates them (Megatron's init_state_fn) before it starts that engine, and returns the cached
    blocks to the GPU; the first step then computes exactly what it would have. A colocated engine's
    memory resume follows torch.cuda.empty_cache()."""
    import types

    from sparse_rl_mega.learner.optimizer_state import allocate_optimizer_state
    from sparse_rl_mega.rollout.engine import RolloutEngine

    def megatron_init_state(opt, config=None):  # (megatron/core/optimizer/__init__.py's, for Adam)
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    models, optimizers = [], []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Linear(5, 3))
        optimizers.append(torch.optim.AdamW(models[-1].parameters(), lr=0.1, weight_decay=0.1))
    part = types.SimpleNamespace(optimizer=optimizers[0], config=None, init_state_fn=megatron_init_state)
    freed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append("empty_cache"))
    assert allocate_optimizer_state(types.SimpleNamespace(chained_optimizers=[part])) == 2 * 4 * (15 + 3) + 2 * 4
    assert freed == ["empty_cache"] and all(len(optimizers[0].state[p]) == 3 for p in models[0].parameters())
    for _ in range(2):
        for model, opt in zip(models, optimizers):
            model(torch.ones(2, 5)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))

    order = []
    engine = RolloutEngine.__new__(RolloutEngine)
    engine.engine = None
    engine._call = lambda what, call: order.append(what)
    monkeypatch.setattr("sparse_rl_mega.rollout.sglang_internals.resume_memory", lambda e: None)
    freed.clear()
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("empty_cache"))
    engine.resume_memory()
    assert order == ["empty_cache", "memory resume"]
