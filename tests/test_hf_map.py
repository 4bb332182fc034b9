"""HF <-> Megatron canonical name/shape map: exact round trips and the fused layouts."""
import torch

from sparse_rl_mega.config import ArchConfig
from sparse_rl_mega.learner.hf_map import hf_to_mcore, mcore_to_hf


def _random_hf(arch: ArchConfig, bias: bool):
    g = torch.Generator().manual_seed(0)
    h, hd = arch.hidden_size, arch.hidden_size // arch.num_attention_heads
    kv = arch.num_query_groups * hd
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (arch.ffn_hidden_size, h),
                       p + "mlp.up_proj.weight": (arch.ffn_hidden_size, h),
                       p + "mlp.down_proj.weight": (h, arch.ffn_hidden_size)})
        if bias:
            shapes.update({p + "self_attn.q_proj.bias": (h,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_round_trip_is_bit_exact():
    for family, bias in (("llama", False), ("qwen2", True)):
        arch = ArchConfig(family=family, num_layers=3, hidden_size=48, ffn_hidden_size=80, num_attention_heads=6,
                          num_query_groups=2, vocab_size=40, qkv_bias=bias)
        hf = _random_hf(arch, bias)
        back = mcore_to_hf(hf_to_mcore(hf, arch), arch)
        assert back.keys() == hf.keys()
        for k in hf:
            assert torch.equal(back[k], hf[k]), k


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
