"""Bounds on floating-point disagreement, derived from the computation instead of fitted to one CPU.

Two implementations of the same math (Megatron against transformers, one layout against another, an
engine against a reference decoder) agree only up to rounding, and how they round depends on the
kernels a CPU runs (AVX2 or AVX-512 reductions, MKL's GEMM blocking for a given shape, the thread
count). The classical bound for a sum or dot product of n terms computed in any order is
``gamma_n = n u / (1 - n u)`` relative to the sum of the terms' magnitudes (Higham, *Accuracy and
Stability of Numerical Algorithms*, 3.1), ``u`` the unit roundoff (2^-24 for float32, 2^-53 for
float64). A value that passes through a chain of such reductions (a forward pass, its backward) has
``n`` = the sum of their lengths: :func:`forward_depth`. That is the bound used where two float32
computations are compared; where exactness is the point the comparison is made in float64, where the
same bound is ~5e8 times smaller than any mapping, sharding or normalisation bug.
"""
from __future__ import annotations

import types

U32 = 2.0 ** -24
U64 = 2.0 ** -53


def gamma(n: int, unit: float) -> float:
    """Higham's gamma_n: the relative rounding bound of an n-term reduction."""
    assert n * unit < 1, (n, unit)
    return n * unit / (1 - n * unit)


def forward_depth(layers: int, hidden: int, ffn: int, head_dim: int, seq: int, vocab: int) -> int:
    """Reduction terms along the longest path from the embedding to a logprob: per layer the QKV
    projection (hidden), the scores (head_dim), the weighted sum of values (<= seq), the output
    projection (heads x head_dim ~ hidden), the gate/up projection (hidden) and the down projection
    (ffn); then the output layer (hidden) and the log-softmax's sum over the vocabulary."""
    return layers * (hidden + head_dim + seq + hidden + hidden + ffn) + hidden + vocab


def _rms_norm(norm, x):
    return norm.weight * (x * (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).rsqrt())


def float64_causal_lm(model_dir):
    """A transformers model computed wholly in float64. Its eager attention takes the softmax in float32
    and its RMSNorm computes in float32 even for float64 weights: SDPA and a float64 RMSNorm keep every
    operation in float64 (RoPE's angles are float32 in transformers and Megatron alike)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa").eval()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm, module)
    return model


def softmax_error(dot_terms: int, logit_mass: float, length: int, unit: float = U32) -> float:
    """Absolute error bound of one probability ``softmax(z)_j`` (<= 1) computed in float with unit ``unit``
    from exact inputs, where each logit ``z`` is a scaled dot product of ``dot_terms`` terms whose
    magnitudes sum to at most ``logit_mass``: the logits carry ``gamma_(n+2) logit_mass`` (the inputs' cast
    to float adds 2 roundings per term), which a softmax turns into a relative error of twice that
    (numerator and normaliser); the normaliser's sum over ``length`` terms adds ``gamma_length``; exp,
    the subtraction of the maximum and the division add a few units (4u)."""
    return 2 * gamma(dot_terms + 2, unit) * logit_mass + gamma(length, unit) + 4 * unit


def logit_mass(keys, queries, scaling: float) -> float:
    """``scaling x max over (query, key) of sum_i |q_i k_i|`` for ``keys [..., L, d]``, ``queries [..., Q, d]``
    (leading axes broadcast; any grouping of query heads onto KV heads is covered by taking all pairs)."""
    k = keys.double().abs().reshape(-1, keys.shape[-1])
    q = queries.double().abs().reshape(-1, queries.shape[-1])
    return scaling * float((q @ k.T).max())
