"""When a request is compressed (:func:`should_compress`: the engine's rule), and what compression did to
one request, replayed from its lengths alone."""
from __future__ import annotations

from typing import NamedTuple, Optional



def should_compress(cached_len: int, budget: int, interval: int, decode_queries: int = 0,
                    queries_needed: int = 0, at_newline: bool = False) -> bool:
    """True when a request with ``cached_len`` tokens in its KV cache must be compressed now: it
    reached ``budget + interval``, or (newline trigger) it is past the budget and the token about to be
    decoded ends a line (``at_newline``). Scoring policies also need ``queries_needed`` decode queries."""
    due = cached_len >= budget + interval or (at_newline and cached_len > budget)
    return due and decode_queries >= queries_needed



class CompressionReplay(NamedTuple):
    compressions: int
    evicted_tokens: int
    peak_tokens: int  # the most KV one decode step attended over (after its compression, with the step's token)



def replay_compression(prompt_len: int, response_len: int, budget: int, interval: int,
                       queries_needed: int = 0, newline_at: Optional[list[bool]] = None) -> CompressionReplay:
    """What compression did to one request, from lengths alone.

    Replays the trigger of :func:`should_compress` over the request's decode steps (the first response
    token comes from the prefill; decode step ``t`` feeds response token ``t - 1``); ``newline_at[t]``
    says whether response token ``t`` ends a line (newline trigger). The engine follows the same rule,
    except when it has to postpone a compression for lack of free slots. A request that is never
    compressed peaks at ``prompt_len + response_len - 1`` (its dense KV; the last token is not fed)."""
    cached, compressions, evicted, peak = prompt_len, 0, 0, prompt_len
    for step in range(1, response_len):
        at_newline = bool(newline_at[step - 1]) if newline_at is not None else False
        if should_compress(cached, budget, interval, step - 1, queries_needed, at_newline):
            evicted += cached - budget
            cached = budget
            compressions += 1
        cached += 1
        peak = max(peak, cached)
    return CompressionReplay(compressions, evicted, peak)



def compression_schedule(prompt_len: int, response_len: int, budget: int, interval: int,
                         queries_needed: int = 0, newline_at: Optional[list[bool]] = None) -> tuple[int, int]:
    """``(compressions, evicted_tokens)`` of one request (:func:`replay_compression`)."""
    replayed = replay_compression(prompt_len, response_len, budget, interval, queries_needed, newline_at)
    return replayed.compressions, replayed.evicted_tokens
