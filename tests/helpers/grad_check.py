"""Run under torchrun by tests/test_layout_invariance.py: a list of jobs, each at its own TP/PP/CP/DP
layout, in one torchrun session (Megatron's model-parallel state is re-initialised between jobs, so
the processes start once for all of them). Rank 0 saves one result per job name.

    torchrun --nproc-per-node W tests/helpers/grad_check.py OUT.pt JOBS_JSON

JOBS_JSON: a list of ``{"name", "kind", "model", "tp", "pp", "mbs", "parallel", "dtypes"}``; ``parallel``
holds more ``parallel`` settings, e.g. ``{"recompute": "full"}`` or ``{"context_parallel_size": 2}``;
``dtypes``: the learner's dtypes to differentiate in (float32 and/or float64).

kind "gradient": the full corrected loss's gradient of the fixed global batch of grad_batch.py (every
correction active), in the job's dtypes, for each loss of grad_batch.LOSSES, gathered in HF names;
also how often the layers and their core attention ran forward in the training pass against the
no-grad pass (activation recomputation runs them twice).

kind "optimizer": two optimizer steps on that batch with the replicated Adam and with Megatron's
distributed optimizer (float32): the weights after them, the step metrics, and how many Adam state
values each rank holds; then a step with a NaN advantage (skipped?) and a normal one.
"""
import json
import sys

from common import init_process_group, run_config, set_layout  # (first: CPU shims before Megatron)

import torch
import torch.distributed as dist

from grad_batch import ALGORITHM, GROUP, LOSSES, N, fill_loss_inputs, synthetic_batch


def _local_batch(cfg, learner, dtype):
    """This DP rank's rows of the global batch with every loss input set; the correction's metrics."""
    from megatron.core import parallel_state as ps

    from sparse_rl_mega.learner.step import forward_logprobs

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    full = synthetic_batch(cfg.model.arch.vocab_size)
    rows = torch.arange(dp_rank * N // dp, (dp_rank + 1) * N // dp)
    local = full.select(rows)
    dense = forward_logprobs(learner.chunks, local, cfg.trainer.micro_batch_size).to(dtype)
    metrics = fill_loss_inputs(local, dense, rows, full.rewards, group=ps.get_data_parallel_group())
    return local, metrics


class ForwardCounter:
    """Counts forward calls of every transformer layer and of its core attention on this rank."""

    def __init__(self, modules):
        self.calls = {"layer": 0, "core_attention": 0}
        self.handles = []
        for module in modules:
            for layer in module.decoder.layers:
                self.handles.append(layer.register_forward_hook(self._count("layer")))
                self.handles.append(layer.self_attention.core_attention.register_forward_hook(
                    self._count("core_attention")))

    def _count(self, key):
        def hook(*_):
            self.calls[key] += 1
        return hook

    def take(self) -> dict:
        calls, self.calls = self.calls, {key: 0 for key in self.calls}
        return calls

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _world_sum(calls: dict) -> dict:
    values = torch.tensor([calls[k] for k in sorted(calls)], dtype=torch.float64)
    dist.all_reduce(values)
    return dict(zip(sorted(calls), values.tolist()))


def gradient_job(cfg, model_dir, job_dtypes=("float32", "float64")) -> dict:
    from megatron.core import parallel_state as ps

    from sparse_rl_mega.learner.model import build_learner
    from sparse_rl_mega.learner.step import REPORT_KEYS, forward_backward, forward_logprobs, sum_report
    from sparse_rl_mega.learner.weights import gather_hf_state_dict, load_hf_into_learner

    results = {}
    for dtype_name in job_dtypes:
        dtype = getattr(torch, dtype_name)
        cfg.model.dtype = dtype_name  # float64: rounding out of the way, the algorithm must agree exactly
        learner = build_learner(cfg)
        load_hf_into_learner(learner, model_dir, cfg.model.arch)
        local, metrics = _local_batch(cfg, learner, dtype)
        results[dtype_name] = {"metrics": metrics}
        params = [p for chunk in learner.modules for p in chunk.parameters()]
        saved = [p.data.clone() for p in params]
        counter = ForwardCounter(learner.modules)
        for mode, denominator in LOSSES:
            cfg.algorithm.loss_agg_mode, cfg.algorithm.loss_denominator = mode, denominator
            counter.take()
            report = sum_report(forward_backward(learner, local, cfg.algorithm, cfg.trainer.micro_batch_size))
            trained = _world_sum(counter.take())
            forward_logprobs(learner.chunks, local, cfg.trainer.micro_batch_size)
            plain = _world_sum(counter.take())
            for p in params:  # expose the reduced, scaled gradients through the weight-gather path
                p.data.copy_(p.main_grad)
            grads = gather_hf_state_dict(learner.modules, cfg.model.arch)
            for p, original in zip(params, saved):
                p.data.copy_(original)
            values = dict(zip(REPORT_KEYS, report.tolist()))
            # the loss report lives on the last stage; rank 0 may be elsewhere
            loss = torch.tensor([values["loss_sum"] / values["count"] if ps.is_pipeline_last_stage() else -1e30],
                                dtype=torch.float64)
            dist.all_reduce(loss, op=dist.ReduceOp.MAX)
            results[dtype_name][f"{mode}/{denominator}"] = {"grads": grads, "loss": float(loss),
                                         "forward_calls": {k: trained[k] / plain[k] for k in trained}}
        counter.remove()
    return results


def optimizer_job(cfg, model_dir) -> dict:
    from sparse_rl_mega.learner.model import build_learner
    from sparse_rl_mega.learner.step import train_step
    from sparse_rl_mega.learner.weights import gather_hf_state_dict, load_hf_into_learner

    cfg.model.dtype = "float32"
    results = {}
    for sharded in (False, True):
        cfg.parallel.use_distributed_optimizer = sharded
        learner = build_learner(cfg)
        load_hf_into_learner(learner, model_dir, cfg.model.arch)
        local, _ = _local_batch(cfg, learner, torch.float32)
        steps = [train_step(learner, local, cfg.algorithm, cfg.trainer.micro_batch_size) for _ in range(2)]
        inner = getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])
        state_values = sum(t.numel() for opt in inner for s in opt.optimizer.state.values()
                           for k, t in s.items() if k == "exp_avg")
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, state_values)
        params = sum(p.numel() for chunk in learner.modules for p in chunk.parameters())
        weights = gather_hf_state_dict(learner.modules, cfg.model.arch)
        results["distributed" if sharded else "replicated"] = {
            "weights": weights, "steps": steps, "adam_values_per_rank": held, "params_per_rank": params,
            "non_finite": _non_finite_step(cfg, learner, local, weights, inner)}
    return results


def _non_finite_step(cfg, learner, local, weights, inner) -> dict:
    """A step whose batch has one NaN advantage (loss and gradients NaN), then a normal one: metrics,
    and whether the NaN step left weights and Adam's state exactly as they were."""
    import copy

    from sparse_rl_mega.learner.step import train_step
    from sparse_rl_mega.learner.weights import gather_hf_state_dict

    adam = [t.clone() for opt in inner for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    poisoned = copy.copy(local)
    poisoned.advantages = local.advantages.clone()
    poisoned.advantages[0] = float("nan")
    skipped = train_step(learner, poisoned, cfg.algorithm, cfg.trainer.micro_batch_size)
    after = gather_hf_state_dict(learner.modules, cfg.model.arch)
    adam_after = [t for opt in inner for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    unchanged = [weights is None or bool(all(torch.equal(after[k], w) for k, w in weights.items())),  # (rank 0 gathers)
                 bool(len(adam) == len(adam_after) and all(torch.equal(a, b) for a, b in zip(adam, adam_after)))]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, unchanged)
    following = train_step(learner, local, cfg.algorithm, cfg.trainer.micro_batch_size)
    return {"skipped": skipped, "weights_unchanged": all(u[0] for u in everyone),
            "adam_unchanged": all(u[1] for u in everyone), "following": following}


def main() -> None:
    out_path, jobs = sys.argv[1], json.loads(sys.argv[2])
    init_process_group()
    results = {}
    for job in jobs:
        parallel = job.get("parallel", {})
        set_layout(job["tp"], job["pp"], parallel.get("virtual_pipeline_model_parallel_size", 1),
                   parallel.get("context_parallel_size", 1))
        cfg = run_config(job["model"], job["tp"], job["pp"], GROUP, N, job["mbs"], dict(ALGORITHM), parallel)
        if job["kind"] == "gradient":
            results[job["name"]] = gradient_job(cfg, job["model"], job.get("dtypes", ("float32", "float64")))
        else:
            results[job["name"]] = optimizer_job(cfg, job["model"])
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
