"""A pure-torch decoder over an HF Llama/Qwen2 model that applies a KV eviction policy.

It is the oracle for the engine patch: it replays a generated sequence token by token (teacher
forcing) with its own KV cache, compresses that cache exactly when and how the engine does, and
returns the logprob of every generated token. Users can run it to debug a policy on a few prompts.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from sparse_rl_mega.kv.policies import EvictionPolicy, should_compress


class ReferenceDecoder:
    """Teacher-forced decoding with a compressed KV cache over an HF ``*ForCausalLM`` (eval mode)."""

    def __init__(self, hf_model: torch.nn.Module):
        self.model = hf_model.eval()
        cfg = hf_model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.no_grad()
    def _forward(self, ids: Sequence[int], positions: Sequence[int], cache: list) -> torch.Tensor:
        """Run ``ids`` at ``positions`` through the model, appending to ``cache``; returns logprobs
        ``[len(ids), vocab]`` (float32)."""
        inner = self.model.model
        n = len(ids)
        hidden = inner.embed_tokens(torch.tensor([list(ids)]))
        cos, sin = inner.rotary_emb(hidden, torch.tensor([list(positions)]))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, n, head_dim]
        groups = self.num_heads // self.num_kv_heads
        for layer_idx, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(1, n, self.num_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            past_k, past_v = cache[layer_idx]
            keys = k if past_k is None else torch.cat([past_k, k], dim=2)
            values = v if past_v is None else torch.cat([past_v, v], dim=2)
            cache[layer_idx] = (keys, values)
            total = keys.shape[2]
            scores = q @ keys.repeat_interleave(groups, dim=1).transpose(-1, -2) * self.head_dim ** -0.5
            visible = torch.ones(n, total, dtype=torch.bool)
            visible[:, total - n:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            scores = scores.masked_fill(~visible, float("-inf"))
            out = scores.float().softmax(-1).to(values.dtype) @ values.repeat_interleave(groups, dim=1)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = self.model.lm_head(inner.norm(hidden))[0].float()
        return torch.log_softmax(logits, dim=-1)

    @torch.no_grad()
    def logprobs(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 policy: Optional[EvictionPolicy] = None, budget: int = 0, interval: int = 1
                 ) -> tuple[list[float], int]:
        """Logprob of each ``output_ids[t]`` given the prompt and earlier outputs.

        With ``policy`` set, the KV cache is compressed to ``budget`` whenever
        :func:`should_compress` says so, before each decode step (the prompt's prefill is never
        compressed). Returns ``(logprobs, evicted_token_count)``.
        """
        cache = [(None, None)] * len(self.model.model.layers)
        logprobs = [float(self._forward(prompt_ids, range(len(prompt_ids)), cache)[-1, output_ids[0]])]
        evicted = 0
        for t in range(1, len(output_ids)):
            cached = cache[0][0].shape[2]
            if policy is not None and should_compress(cached, budget, interval):
                if not policy.position_only:
                    raise NotImplementedError("the reference decoder handles position-only policies so far")
                kept = policy.select(None, None, budget, length=cached)
                cache = [(k[:, :, kept], v[:, :, kept]) for k, v in cache]
                evicted += cached - kept.numel()
            position = len(prompt_ids) + t - 1
            logprobs.append(float(self._forward([output_ids[t - 1]], [position], cache)[-1, output_ids[t]]))
        return logprobs, evicted
