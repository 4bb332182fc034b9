"""A pure-torch decoder over an HF Llama/Qwen2 model that applies a KV eviction policy.

It is the oracle for the engine patch: it replays a generated sequence token by token (teacher
forcing) with its own KV cache, compresses that cache exactly when and how the engine does, and
returns the logits or the logprob of every generated token (at a sampling temperature and over a
top-k / top-p support, as the engine samples). Users can run it to debug a policy on a few prompts:

    decoder = ReferenceDecoder(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    logprobs, evicted = decoder.logprobs(prompt_ids, output_ids, build_policy("rkv", sink=4, window=8),
                                         budget=64, interval=16)

What it reproduces: the prefill is never compressed; each decode step records its post-RoPE query
per layer and (for H2O) adds the attention it paid to every key; before a decode step, a cache of
``budget + interval`` tokens (with enough recorded queries for the policy) is compressed to
``budget`` per layer, per KV head or with one set for every layer (the policy's ``selection``), keys
keeping their original rotation.
"""
from __future__ import annotations

from typing import Any, Optional
from collections.abc import Sequence

import torch

from sparse_rl_mega.kv.attention_mass import decode_attention_mass
from sparse_rl_mega.kv.base import EvictionPolicy
from sparse_rl_mega.kv.replay import should_compress


class ReferenceDecoder:
    """Teacher-forced decoding with a compressed KV cache over an HF ``*ForCausalLM`` (eval mode)."""

    def __init__(self, hf_model: torch.nn.Module):
        # (transformers' modules and config are typed by attribute at run time: Any here)
        self.model: Any = hf_model.eval()
        cfg: Any = hf_model.config
        self.head_dim: int
        self.num_heads: int
        self.num_kv_heads: int
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    @torch.no_grad()
    def _forward(self, ids: Sequence[int], positions: Sequence[int], state: dict[str, Any],
                 model: Optional[torch.nn.Module] = None) -> torch.Tensor:
        """Run ``ids`` at ``positions`` through ``model`` (default: the decoder's), appending to the
        cache in ``state``; returns logits ``[len(ids), vocab]`` (float32). A single-token call is a
        decode step: its queries are recorded and, for H2O, its attention is accumulated."""
        model_: Any = model if model is not None else self.model
        inner = model_.model
        n = len(ids)
        decode = state["prefilled"]
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
            keys = torch.cat([state["k"][layer_idx], k[0]], dim=1)  # [kv_heads, total, d]
            values = torch.cat([state["v"][layer_idx], v[0]], dim=1)
            state["k"][layer_idx], state["v"][layer_idx] = keys, values
            total = keys.shape[1]
            scores = q[0] @ keys.repeat_interleave(groups, dim=0).transpose(-1, -2) * self.head_dim ** -0.5
            visible = torch.ones(n, total, dtype=torch.bool)
            visible[:, total - n:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            scores = scores.masked_fill(~visible, float("-inf"))
            out = scores.float().softmax(-1).to(values.dtype) @ values.repeat_interleave(groups, dim=0)
            hidden = hidden + attn.o_proj(out.unsqueeze(0).transpose(1, 2).reshape(1, n, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if decode:
                state["queries"][layer_idx].append(q[0, :, 0])  # [q_heads, d]
                mass = decode_attention_mass(keys, q[0, :, 0], self.head_dim ** -0.5)
                acc = state["acc"][layer_idx]
                state["acc"][layer_idx] = torch.cat([acc, acc.new_zeros(acc.shape[0], total - acc.shape[1])], 1) + mass
        state["prefilled"] = True
        logits: torch.Tensor = model_.lm_head(inner.norm(hidden))[0].float()
        return logits

    def _compress(self, state: dict[str, Any], policy: EvictionPolicy, budget: int) -> int:
        """Compress every layer's cache to ``budget`` (per the policy's ``selection``); returns the
        evicted token count."""
        cached: int = state["k"][0].shape[1]
        if policy.position_only:
            kept = policy.select(None, None, budget, length=cached)
        else:
            window_queries = None
            if policy.queries_needed:  # [1, layers, q_heads, w, d]
                window_queries = torch.stack([torch.stack(q[-policy.window:], dim=1) for q in state["queries"]])[None]
            accumulated = torch.stack(state["acc"])[None] if policy.needs_accumulated else None
            kept = policy.select_layers(torch.stack(state["k"])[None], window_queries, budget, accumulated)[0]
        for layer_idx in range(len(state["k"])):
            layer_kept = kept if policy.shared else kept[layer_idx]  # [budget] or [kv_heads, budget]
            if layer_kept.dim() == 1:
                layer_kept = layer_kept.expand(self.num_kv_heads, -1)
            gather = layer_kept.unsqueeze(-1).expand(-1, -1, self.head_dim)
            state["k"][layer_idx] = state["k"][layer_idx].gather(1, gather)
            state["v"][layer_idx] = state["v"][layer_idx].gather(1, gather)
            state["acc"][layer_idx] = state["acc"][layer_idx].gather(1, layer_kept)
        return cached - budget

    @torch.no_grad()
    def logits(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
               policy: Optional[EvictionPolicy] = None, budget: int = 0, interval: int = 1,
               newline_token_ids: Sequence[int] = (),
               later_model: Optional[tuple[int, torch.nn.Module]] = None) -> tuple[torch.Tensor, int]:
        """The logits ``[len(output_ids), vocab]`` (float32) that predict each ``output_ids[t]`` given the
        prompt and earlier outputs, compressing as the engine does (``policy`` None: dense;
        ``newline_token_ids``: the newline trigger's tokens). ``later_model`` ``(t, model)``: the decode
        steps that predict ``output_ids[t:]`` run through ``model`` on the cache as it is (new weights
        after a push mid-response, the KV computed before kept: a partial rollout's stale KV). Returns
        ``(logits, evicted_token_count)``."""
        layers = len(self.model.model.layers)
        empty = torch.zeros(self.num_kv_heads, 0, self.head_dim)
        state: dict[str, Any] = {"k": [empty] * layers, "v": [empty] * layers, "queries": [[] for _ in range(layers)],
                 "acc": [torch.zeros(self.num_kv_heads, len(prompt_ids)) for _ in range(layers)], "prefilled": False}
        steps = [self._forward(prompt_ids, range(len(prompt_ids)), state)[-1]]
        evicted = 0
        for t in range(1, len(output_ids)):
            cached = state["k"][0].shape[1]
            if policy is not None and should_compress(cached, budget, interval, len(state["queries"][0]),
                                                      policy.min_decode_queries,
                                                      output_ids[t - 1] in newline_token_ids):
                evicted += self._compress(state, policy, budget)
            position = len(prompt_ids) + t - 1
            model = later_model[1] if later_model is not None and t >= later_model[0] else None
            steps.append(self._forward([output_ids[t - 1]], [position], state, model)[-1])
        return torch.stack(steps), evicted

    def logprobs(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 policy: Optional[EvictionPolicy] = None, budget: int = 0, interval: int = 1,
                 newline_token_ids: Sequence[int] = (), temperature: float = 1.0,
                 supports: Optional[Sequence[Sequence[int]]] = None,
                 later_model: Optional[tuple[int, torch.nn.Module]] = None) -> tuple[list[float], int]:
        """Logprob of each ``output_ids[t]`` under ``softmax(logits / temperature)`` (:meth:`logits`),
        renormalised over ``supports[t]`` when given (the ids a top-k / top-p truncation kept), as the
        engine samples. Returns ``(logprobs, evicted_token_count)``."""
        logits, evicted = self.logits(prompt_ids, output_ids, policy, budget, interval, newline_token_ids,
                                      later_model)
        scaled = logits / temperature
        if supports is not None:
            outside = torch.ones_like(scaled, dtype=torch.bool)
            for t, ids in enumerate(supports):
                outside[t, list(ids)] = False
            scaled = scaled.masked_fill(outside, float("-inf"))
        logp = torch.log_softmax(scaled, dim=-1).gather(-1, torch.tensor(list(output_ids))[:, None])[:, 0]
        return logp.tolist(), evicted
