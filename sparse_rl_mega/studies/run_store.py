"""An ablation's runs as its MLflow store holds them: the newest run of each variant, whether it finished,
and its metric histories and held-out evaluations."""
from __future__ import annotations

import json
from pathlib import Path

from sparse_rl_mega.studies.plots import CURVES

EXPERIMENT = "ablation"


def latest_run(client, name: str):
    """The newest MLflow run of variant ``name`` in the ablation experiment, or None."""
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.mlflow.runName = '{name}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def finished(tracking_uri: str, name: str, iterations: int) -> bool:
    """Whether variant ``name`` already has a finished run in the store with all ``iterations`` logged."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    run = latest_run(client, name)
    return run is not None and run.info.status == "FINISHED" and \
        len(client.get_metric_history(run.info.run_id, "reward/mean")) == iterations


def collect(tracking_uri: str, names: list[str], out: Path) -> dict[str, dict]:
    """Per variant: metric histories (step -> value) and the trainer's held-out evaluations."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    data: dict[str, dict] = {}
    for name in names:
        run = latest_run(client, name)
        if run is None:
            continue
        run_id = run.info.run_id
        curves = {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in CURVES}
        eval_file = out / name / "eval.json"
        evals = json.loads(eval_file.read_text())["history"] if eval_file.is_file() else []
        data[name] = {"run_id": run_id, "curves": curves, "eval": evals}
    return data
