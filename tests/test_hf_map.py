"""HF <-> Megatron canonical name/shape map: exact round trips and the fused layouts for every family
(Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms and wide heads; tied and untied embeddings),
the map covering exactly the tensors of transformers' own models, and reading ``model.arch`` from an
HF ``config.json``."""
import json
import re

import pytest
import torch

from sparse_rl_mega.config import ArchConfig, ConfigError, arch_from_hf_config
from sparse_rl_mega.learner.hf_map import hf_to_mcore, mcore_to_hf

FAMILIES = [  # (family, head_dim, tied)
    ("llama", None, False), ("llama", None, True), ("qwen2", None, False), ("qwen3", 12, True), ("qwen3", 16, False)]


def _random_hf(arch: ArchConfig, bias: bool = False):
    g = torch.Generator().manual_seed(0)
    h, hd = arch.hidden_size, arch.kv_channels
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (arch.ffn_hidden_size, h),
                       p + "mlp.up_proj.weight": (arch.ffn_hidden_size, h),
                       p + "mlp.down_proj.weight": (h, arch.ffn_hidden_size)})
        if bias or arch.has_qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if arch.qk_layernorm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize("family, head_dim, tied", FAMILIES)
def test_round_trip_is_bit_exact(family, head_dim, tied):
    arch = ArchConfig(family=family, num_layers=3, hidden_size=48, ffn_hidden_size=80, num_attention_heads=6,
                      num_query_groups=2, vocab_size=40, head_dim=head_dim, tie_word_embeddings=tied)
    hf = _random_hf(arch)
    canonical = hf_to_mcore(hf, arch)
    rows = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.kv_channels
    assert canonical["decoder.layers.self_attention.linear_qkv.weight"].shape == (3, rows, 48)
    assert ("output_layer.weight" in canonical) == (not tied)
    if family == "qwen3":
        assert canonical["decoder.layers.self_attention.k_layernorm.weight"].shape == (3, arch.kv_channels)
    back = mcore_to_hf(canonical, arch)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("family, head_dim, tied", FAMILIES)
def test_map_covers_exactly_the_tensors_of_transformers_models(family, head_dim, tied):
    """Every tensor of transformers' own model maps (none ignored), with the shapes it has there."""
    from transformers import AutoModelForCausalLM

    from sparse_rl_mega.models.tiny import hf_config

    arch = ArchConfig(family=family, num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                      num_query_groups=2, vocab_size=64, head_dim=head_dim, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch, eos_id=0))
    hf = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    back = mcore_to_hf(hf_to_mcore(hf, arch), arch)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_missing_hf_tensor_is_named():
    arch = ArchConfig(family="qwen3", num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                      num_query_groups=2, vocab_size=64, head_dim=16)
    hf = _random_hf(arch)
    del hf["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight.*k_layernorm"):
        hf_to_mcore(hf, arch)


def test_arch_from_hf_config_reads_every_family(tmp_path):
    from sparse_rl_mega.models.tiny import hf_config

    for family, head_dim, tied in FAMILIES:
        arch = ArchConfig(family=family, num_layers=2, hidden_size=48, ffn_hidden_size=80, num_attention_heads=6,
                          num_query_groups=2, vocab_size=40, head_dim=head_dim, tie_word_embeddings=tied,
                          rope_theta=1e6, norm_eps=1e-5, max_position_embeddings=256)
        hf_config(arch, eos_id=0).save_pretrained(tmp_path / family)
        read = ArchConfig(**arch_from_hf_config(tmp_path / family))
        assert read.kv_channels == arch.kv_channels and read.has_qkv_bias == arch.has_qkv_bias
        assert (read.family, read.rope_theta, read.tie_word_embeddings, read.num_query_groups) == \
            (family, 1e6, tied, 2)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     r"config.json: rope_scaling: rope_type 'dynamic' is not supported \(supported: default, llama3, linear"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "config.json: rope_parameters: rope_type 'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     r"config.json: rope_parameters: low_freq_factor must be > 0 \(required for rope_type llama3\), got None"),
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}},
     "config.json: rope_scaling: high_freq_factor must exceed low_freq_factor = 1.0"),
    ({"rope_scaling": {**LLAMA3, "factor": "8"}}, "config.json: rope_scaling: factor = '8': expected a number"),
    ({"rope_scaling": {**LLAMA3, "factor": 0.5}}, "config.json: rope_scaling: factor must be >= 1"),
    ({"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8192.0}},
     "original_max_position_embeddings = 8192.0: expected an integer"),
    ({"rope_scaling": {**LLAMA3, "attention_factor": 1.0}},
     "config.json: rope_scaling: attention_factor is not supported with rope_type 'llama3'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
     "rope_scaling: low_freq_factor is not supported with rope_type 'linear'"),
    ({"rope_scaling": [8.0]}, r"config.json: rope_scaling = \[8.0\]: expected a mapping"),
    ({"mlp_bias": True}, "mlp_bias = True is not supported"),
])
def test_arch_from_hf_config_rejects_what_the_map_cannot_carry(tmp_path, change, message):
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        arch_from_hf_config(tmp_path)


def test_qkv_is_interleaved_by_query_group():
    arch = ArchConfig(num_layers=1, hidden_size=8, ffn_hidden_size=4, num_attention_heads=4, num_query_groups=2,
                      vocab_size=4)
    hf = _random_hf(arch, False)
    hd = 2
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    fused = hf_to_mcore(hf, arch)["decoder.layers.self_attention.linear_qkv.weight"][0]
    # group 1 starts after group 0's 2 query heads + 1 key head + 1 value head
    start = (2 + 1 + 1) * hd
    assert torch.equal(fused[start:start + 2 * hd], q[2 * hd:4 * hd])
    assert torch.equal(fused[start + 2 * hd:start + 3 * hd], k[hd:2 * hd])
    assert torch.equal(fused[start + 3 * hd:start + 4 * hd], v[hd:2 * hd])


def test_fp8_parameters_take_their_masters_from_the_checkpoint_values():
    """model.fp8_param: the optimizer's fp32 masters of an FP8 parameter are initialised from the values
    read from the HF checkpoint (Megatron's reload_model_params(state_dict)), not dequantized from the
    FP8 parameter; the other parameters give their own values; names as Megatron matches them (the
    wrappers' 'module.' prefixes stripped); without FP8 parameters the masters come from the parameters
    (None); an FP8 parameter the load wrote through a view keeps Megatron's dequantized values, said in
    one line."""
    from sparse_rl_mega.learner.weights import master_values

    class Wrapper(torch.nn.Module):  # (DDP / Float16Module: 'module.' prefixes)
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    chunks = [Wrapper(Wrapper(torch.nn.Linear(3, 2))), Wrapper(torch.nn.Linear(2, 2))]
    weight = chunks[0].module.module.weight
    read = torch.randn(2, 3, dtype=torch.float64)
    fp8 = {id(weight)}
    out = master_values(chunks, {id(weight): read}, fp8=lambda p: id(p) in fp8)
    assert set(out) == {"model0", "model1"} and set(out["model0"]) == {"weight", "bias"}
    assert out["model0"]["weight"] is read and out["model0"]["bias"] is not None
    assert torch.equal(out["model1"]["weight"], chunks[1].module.weight)
    assert master_values(chunks, {}, fp8=lambda p: False) is None
    lines = []
    out = master_values(chunks, {}, fp8=lambda p: id(p) in fp8, log=lines.append)  # (written through a view)
    assert out["model0"]["weight"] is weight and len(lines) == 1 and "module.module.weight" in lines[0]


def _saved_llama(folder, rope_scaling, **arch_keys):
    """A random tiny Llama saved by transformers (its 5.x layout: ``rope_parameters``): folder, arch, state."""
    from transformers import AutoModelForCausalLM

    from sparse_rl_mega.config import RopeScalingConfig
    from sparse_rl_mega.models.tiny import hf_config

    arch = ArchConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                      vocab_size=64, head_dim=8, rope_theta=5e5, max_position_embeddings=256,
                      rope_scaling=RopeScalingConfig(**rope_scaling), **arch_keys)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch, eos_id=0))
    model.save_pretrained(folder)
    return arch, model.state_dict()


def _read_arch(folder) -> ArchConfig:
    from sparse_rl_mega.config import RopeScalingConfig

    read = arch_from_hf_config(folder)
    return ArchConfig(**{**read, "rope_scaling": read.get("rope_scaling") and RopeScalingConfig(**read["rope_scaling"])})


@pytest.mark.parametrize("rope_scaling", [
    {**LLAMA3, "original_max_position_embeddings": 64},  # Llama-3.1's values over 64 positions
    {"rope_type": "linear", "factor": 2.0}])
def test_rope_scaling_round_trips_through_config_map_and_export(tmp_path, rope_scaling):
    """An arch with RoPE scaling written as config.json by the tiny model's writer reads back equal; its
    weights round trip HF -> Megatron -> HF bit for bit; the export's copy of config.json (its dtype
    rewritten) keeps the rope section as it was, and reads back the same arch."""
    from sparse_rl_mega.learner.export import copy_model_files

    arch, state = _saved_llama(tmp_path / "hf", rope_scaling)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["rope_parameters"] == {**rope_scaling, "rope_theta": 5e5}, written
    assert _read_arch(tmp_path / "hf") == arch
    back = mcore_to_hf(hf_to_mcore(state, arch), arch)
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
    (tmp_path / "out").mkdir()
    copy_model_files(tmp_path / "hf", tmp_path / "out", "bfloat16")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["dtype"] == "bfloat16" and exported["rope_parameters"] == written["rope_parameters"]
    assert _read_arch(tmp_path / "out") == arch


def test_rope_scaling_of_the_transformers_4_layout_is_read_and_checked(tmp_path):
    """Llama-3.2-1B's layout (rope_theta at the top, ``rope_scaling`` beside it, factor 32) reads as the 5.x
    layout does, and a model.arch that says otherwise is named key by key."""
    from sparse_rl_mega.config import config_from_dict

    hf = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 131072,
          "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
          "rope_scaling": {**LLAMA3, "factor": 32.0}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    read = arch_from_hf_config(tmp_path)
    assert read["rope_theta"] == 5e5 and read["rope_scaling"] == {**LLAMA3, "factor": 32.0}
    raw = lambda arch: {"model": {"path": str(tmp_path), "arch": arch},  # noqa: E731
                        "data": {"train_path": "unused.jsonl"}}
    cfg = config_from_dict(raw({}))
    assert cfg.model.arch.rope_scaling.factor == 32.0 and cfg.model.arch.rope_original_positions == 8192
    for arch, key, said in [
            ({"rope_scaling": None}, "model.arch.rope_scaling", "none (plain RoPE) disagrees"),
            ({"rope_scaling": {"rope_type": "linear", "factor": 32.0}}, "model.arch.rope_scaling", "'linear' disagrees"),
            ({"rope_scaling": {**LLAMA3, "factor": 8.0}}, "model.arch.rope_scaling.factor", "8.0 disagrees"),
            ({"rope_scaling": {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": None}},
             "model.arch.rope_scaling.original_max_position_embeddings", "131072 disagrees"),
            ({"rope_scaling": {**LLAMA3, "low_freq_factor": 0}}, "model.arch.rope_scaling.low_freq_factor", "must be > 0")]:
        with pytest.raises(ConfigError, match=f"{re.escape(key)}: .*{re.escape(said)}"):
            config_from_dict(raw(arch))
