"""CPU stand-in for ``sgl_kernel`` (installed only into CPU venvs by ``tools/setup_env.sh``).

PyPI carries only CUDA builds of SGLang's kernel package. On a CPU without AMX, SGLang's CPU engine
switches its fused kernels off and only needs this module to import, plus one bookkeeping op used when
a decode batch is prepared and the hash behind seeded sampling (``torch.ops.sgl_kernel.
murmur_hash32_cpu``). Every other name resolves to a function that raises, so a code path that really
needs a kernel fails loudly instead of computing something wrong.
"""
import torch

__version__ = "0.0.0+sparse_rl_mega.cpu"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Write each request's newly allocated KV slots into its ``req_to_token`` row.

    ``out_cache_loc`` holds the slots of all requests back to back; request i receives
    ``end_offset[i] - start_offset[i]`` of them at columns ``[start_offset[i], end_offset[i])``.
    """
    cursor = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[cursor:cursor + count].to(req_to_token.dtype)
        cursor += count


_MASK32 = 0xFFFFFFFF


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One MurmurHash3 block. int64 tensors holding uint32 values; products wrap mod 2^64, which keeps
    the low 32 bits exact."""
    k = (k * 0xCC9E2D51) & _MASK32
    k = ((k << 15) | (k >> 17)) & _MASK32
    k = (k * 0x1B873593) & _MASK32
    h = h ^ k
    h = ((h << 13) | (h >> 19)) & _MASK32
    return (h * 5 + 0xE6546B64) & _MASK32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` uint32 hashes of (seed[i], positions[i], col_indices[j]): the blocks seed low, seed
    high, position, column, then length 16 and the final mix, as SGLang's GPU kernel does."""
    seed = seed.to(torch.int64)
    h = torch.zeros_like(seed)
    h = _mix(h, seed & _MASK32)
    h = _mix(h, (seed >> 32) & _MASK32)
    h = _mix(h, positions.to(torch.int64) & _MASK32)
    h = _mix(h.unsqueeze(1), (col_indices.to(torch.int64) & _MASK32).unsqueeze(0))
    return _fmix(h ^ 16).to(torch.uint32)


_library = torch.library.Library("sgl_kernel", "DEF")
_library.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
_library.impl("murmur_hash32_cpu", murmur_hash32, "CPU")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel_unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in the CPU stand-in; this code path needs a GPU build "
            "of sgl-kernel")

    kernel_unavailable.__name__ = name
    return kernel_unavailable
