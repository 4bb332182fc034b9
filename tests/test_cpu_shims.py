"""The CPU stand-in for sgl_kernel: its murmur hash (seeded sampling) against a plain-integer
MurmurHash3 of the same blocks (seed low, seed high, position, column; length 16)."""
import torch

import sgl_kernel  # noqa: F401 -- registers torch.ops.sgl_kernel.*

MASK = 0xFFFFFFFF


def _mix(h: int, k: int) -> int:
    k = (k * 0xCC9E2D51) & MASK
    k = ((k << 15) | (k >> 17)) & MASK
    k = (k * 0x1B873593) & MASK
    h ^= k
    h = ((h << 13) | (h >> 19)) & MASK
    return (h * 5 + 0xE6546B64) & MASK


def _murmur(seed: int, position: int, column: int) -> int:
    seed &= (1 << 64) - 1
    h = _mix(_mix(_mix(_mix(0, seed & MASK), seed >> 32), position & MASK), column)
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK
    return h ^ (h >> 16)


def test_murmur_hash_matches_integer_reference():
    seeds = torch.tensor([0, 7, 2**62 + 12345, -5])
    positions = torch.tensor([0, 17, 300, 2**20])
    columns = torch.arange(50)
    out = torch.ops.sgl_kernel.murmur_hash32_cpu.default(seeds, positions, columns)
    assert out.dtype == torch.uint32 and out.shape == (4, 50)
    expected = [[_murmur(int(s), int(p), c) for c in range(50)] for s, p in zip(seeds, positions)]
    assert out.to(torch.int64).tolist() == expected
    assert len(set(out[1].tolist())) == 50  # columns hash apart
