"""CPU stand-in for ``sgl_kernel`` (installed only into CPU venvs by ``tools/setup_env.sh``).

PyPI carries only CUDA builds of SGLang's kernel package. On a CPU without AMX, SGLang's CPU engine
switches its fused kernels off and only needs this module to import, plus one bookkeeping op used when
a decode batch is prepared. Every other name resolves to a function that raises, so a code path that
really needs a kernel fails loudly instead of computing something wrong.
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


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel_unavailable(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in the CPU stand-in; this code path needs a GPU build "
            "of sgl-kernel")

    kernel_unavailable.__name__ = name
    return kernel_unavailable
