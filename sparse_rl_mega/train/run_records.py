"""A finished run as its folder holds it, for comparing two runs exactly (``tools/chaos.py``, the resume
and overlap tests): every tensor of its final checkpoint, the last value of each metric at each
iteration (its MLflow store), and what differs between two of them. torch and MLflow are imported when
called (a tool that only launches runs does not load them)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from sparse_rl_mega.train.tracking import default_tracking_uri

# not compared: timings, the engine's restarts, and the engine's logprobs before a push (a restarted engine
# holds the initial weights there)
NOT_COMPARED = ("time/", "engine/restarts", "sync/pre_sync_")


def final_state(run_dir: Path, iterations: int) -> dict[str, Any]:
    """Every tensor of the final checkpoint (model and optimizer), read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = run_dir / "checkpoints" / f"iter_{iterations:07d}"
    if not checkpoint.is_dir():
        return {}
    whole = run_dir / "final_state.pt"
    dcp_to_torch_save(checkpoint, whole)
    state = torch.load(whole, weights_only=False)
    whole.unlink()
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}{key}.", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}{i}.", item)
        elif isinstance(value, torch.Tensor):
            flat[prefix[:-1]] = value
    walk("", state)
    return flat


def metrics_by_iteration(run_dir: Path, skip: tuple[str, ...] = NOT_COMPARED) -> dict[int, dict[str, float]]:
    """The last value logged for each metric at each step, over every run in the store; metrics whose
    name starts with one of ``skip`` (default: the ones chaos does not compare) are left out."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=default_tracking_uri(run_dir))
    out: dict[int, dict[str, float]] = {}
    experiments = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in experiments], order_by=["attributes.start_time ASC"])
    for run in runs:
        for key in run.data.metrics:
            if skip and key.startswith(skip):
                continue
            for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
                out.setdefault(m.step, {})[key] = m.value
    return out


def compare(reference: tuple[dict[str, Any], dict[int, dict[str, float]]],
            trial: tuple[dict[str, Any], dict[int, dict[str, float]]]) -> list[str]:
    """What differs between two (final state, metrics) pairs."""
    (ref_state, ref_metrics), (state, metrics) = reference, trial
    import torch

    diffs = []
    if not state:
        return ["no final checkpoint"]
    if state.keys() != ref_state.keys():
        diffs.append(f"checkpoint keys differ ({len(state)} vs {len(ref_state)})")
    changed = [k for k in ref_state if k in state and not torch.equal(state[k], ref_state[k])]
    if changed:
        diffs.append(f"{len(changed)} checkpoint tensor(s) differ, e.g. {changed[0]}")
    for step in sorted(ref_metrics):
        got = metrics.get(step, {})
        for key, value in ref_metrics[step].items():
            if key not in got:
                diffs.append(f"iteration {step + 1}: {key} missing")
            elif got[key] != value and not (got[key] != got[key] and value != value):  # NaN == NaN here
                diffs.append(f"iteration {step + 1}: {key} {got[key]!r} vs {value!r}")
    return diffs
