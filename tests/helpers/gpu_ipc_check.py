"""Run under torchrun (one process) by tests/test_gpu.py, and on the CPU by tests/test_tools.py: the
weight push's hand-over of flattened buckets to another process, without SGLang.

The learner side is the project's: a Megatron learner (local spec, TP1, random weights of a Llama
shape: ``--shape``, as in gpu_step_check.py) plans its push (``flat_buckets.plan_push``, ``--bucket-mb``
buckets) and packs each bucket into a device buffer (``pack_bucket``). A receiver process of this
check's own (spawned: what an engine's scheduler would be) gets each buffer through torch's
multiprocessing reduction (a CUDA IPC handle on a GPU, a shared-memory file descriptor on the CPU)
with its slots, copies every slot out into tensors of its own (an engine's weight load) and
answers with a digest of every tensor's bytes. Bit for bit: each digest equals that of the HF tensor
gathered from the learner (``weights.gather_hf_state_dict``) in the push dtype. Timed: the receiver's
copy-out of a bucket against a device-to-device copy of the same bytes in this process (fastest of
``--repeats``). Writes JSON to OUT.

    torchrun --nproc-per-node 1 tests/helpers/gpu_ipc_check.py OUT.json [--shape 1b] [--bucket-mb 512]
"""
import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from common import init_parallel  # (first: CPU shims before Megatron)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_step_check import SHAPES, shape_config  # (the same shapes)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def receiver(requests, answers) -> None:
    """Spawned: for each ``(flat, slots, dtype)`` request, copy every slot out into a new tensor (timed,
    after the handle is opened), answer ``(seconds, {name: digest})``; ``None`` ends it."""
    while True:
        request = requests.get()
        if request is None:
            return
        flat, slots, dtype = request  # (flat: the sender's buffer, mapped here)
        synchronize(flat.device)
        started = time.perf_counter()
        received = {name: flat[offset:offset + nbytes].view(dtype).view(shape).clone()
                    for name, shape, offset, nbytes in slots}
        synchronize(flat.device)
        seconds = time.perf_counter() - started
        answers.put((seconds, {name: digest(t) for name, t in received.items()}))
        del flat, received


def answer(answers, child, limit_s: float = 600.0):
    """The receiver's next answer; one line, not a hang, when it died or went silent."""
    import queue

    waited = 0.0
    while waited < limit_s:
        try:
            return answers.get(timeout=2.0)
        except queue.Empty:
            waited += 2.0
            if not child.is_alive():
                raise SystemExit(f"gpu_ipc_check: the receiver process died (exit code {child.exitcode})") from None
    raise SystemExit(f"gpu_ipc_check: no answer from the receiver in {limit_s:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--bucket-mb", type=float, default=512.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from sparse_rl_mega.learner.flat_buckets import pack_bucket, plan_push
    from sparse_rl_mega.learner.model import build_learner
    from sparse_rl_mega.learner.weights import _local_shards, gather_hf_state_dict

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    init_parallel(1, 1)
    cfg = shape_config(args.shape, args.dtype, 16)
    arch, dtype = cfg.model.arch, getattr(torch, args.dtype)
    learner = build_learner(cfg)
    expected = {name: digest(t.to(dtype)) for name, t in gather_hf_state_dict(learner.modules, arch).items()}
    shards = _local_shards(learner.modules, main_replica_only=True)
    plan = plan_push(shards, arch, dtype, int(args.bucket_mb * 2**20))

    context = mp.get_context("spawn")
    requests, answers = context.Queue(), context.Queue()
    child = context.Process(target=receiver, args=(requests, answers), daemon=True)
    child.start()
    received, handover, copies = {}, [], []
    try:
        for bucket in plan.buckets:
            flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
            if not cuda:
                flat.share_memory_()
            pack_bucket(plan, bucket, flat, shards, arch)
            synchronize(device)
            slots = [(s.name, s.shape, s.offset, s.nbytes) for s in bucket.slots]
            best = float("inf")
            for _ in range(args.repeats):
                requests.put((flat, slots, dtype))
                seconds, digests = answer(answers, child)
                best = min(best, seconds)
            received.update(digests)
            target = torch.empty_like(flat)
            best_copy = float("inf")
            for _ in range(args.repeats):
                synchronize(device)
                started = time.perf_counter()
                target.copy_(flat)
                synchronize(device)
                best_copy = min(best_copy, time.perf_counter() - started)
            handover.append(best)
            copies.append(best_copy)
            del flat, target
    finally:
        requests.put(None)
        child.join(timeout=60)
    nbytes = plan.nbytes
    result = {"shape": args.shape, "dtype": args.dtype, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "transport": "CUDA IPC handle" if cuda else "shared memory", "buckets": len(plan.buckets),
              "bytes": nbytes, "tensors": plan.tensors,
              "same_names": sorted(received) == sorted(expected),
              "bit_exact": all(received.get(name) == value for name, value in expected.items()),
              "handover_seconds": sum(handover), "device_copy_seconds": sum(copies),
              "handover_gb_per_s": nbytes / sum(handover) / 1e9, "device_copy_gb_per_s": nbytes / sum(copies) / 1e9,
              "handover_over_copy": sum(handover) / sum(copies)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    sys.exit(0 if result["same_names"] and result["bit_exact"] else 1)


if __name__ == "__main__":
    main()
