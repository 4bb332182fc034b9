"""What a weight push (``sparse_rl_mega/rollout/weight_push.py``) needs inside a CPU scheduler.

1. The shared buffers of flattened buckets stay mapped. A learner rank packs its buckets into the
   same two shared-memory buffers at every push; the scheduler maps the one it is handed, and torch
   maps a buffer anew unless the storage from the last time is still alive (its cache is keyed by the
   shared file). A fresh mapping costs its page faults and its unmapping: a 64 MiB bucket was copied
   out in 12-13 ms plus 4-6 ms to unmap, against 7 ms from a buffer still mapped (a plain copy: 5 ms).
   The storages of the last :data:`KEEP` buffers are kept.
2. A cache flush does not run a full garbage collection. SGLang's CPU ``empty_cache`` is a
   ``gc.collect()`` over the scheduler's heap (its own comment: it frees reference cycles only, no
   memory goes back to the system), 50-140 ms at each of the two flushes of every push here, while
   Python's generational collector runs anyway.
3. Whether the model has weight caches that an online update cannot refresh is asked once per model,
   not at every bucket: SGLang's check walks every module and imports a kernel module each time (3.2 ms
   a bucket here), and its own docstring requires the answer to be fixed at start-up.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

from sparse_rl_mega.rollout import sglang_internals

logger = logging.getLogger("sparse_rl_mega.sglang_patches")

KEEP = 8  # buffers kept mapped: two per bucket owner (pipeline stages), with room for a plan change
_kept: OrderedDict[int, object] = OrderedDict()  # storage data pointer -> storage


def _keep(tensor) -> None:
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    _kept[key] = storage
    _kept.move_to_end(key)
    while len(_kept) > KEEP:
        _kept.popitem(last=False)


def install() -> None:
    import torch

    if torch.cuda.is_available():
        return  # (GPU buckets come as CUDA IPC handles; flushes there empty CUDA's cache, which is cheap)
    sglang_internals.hook_cpu_weight_updates(_keep)
    logger.info("sparse_rl_mega weight-push patches installed")
