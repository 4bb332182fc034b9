"""MLflow tracking (rank 0 only): a local sqlite store inside the run folder unless a tracking URI is
configured; the whole resolved config is logged as parameters and as a YAML artifact."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import yaml

from sparse_rl_mega.config import RunConfig


def _flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def default_run_name(cfg: RunConfig) -> str:
    """What ran, as the MLflow run's name (``tracking.run_name`` overrides it): the config file's name,
    the rollouts' KV policy and budget, the correction preset, e.g. ``cpu_tiny-rkv48-sparse_rl``."""
    kv = cfg.rollout.kv_compression
    config = Path(cfg.config_path).stem if cfg.config_path else Path(cfg.trainer.run_dir).name
    rollouts = "dense" if kv.policy == "none" else f"{kv.policy}{kv.budget}"
    return f"{config}-{rollouts}-{cfg.algorithm.correction.preset}"


def default_tracking_uri(run_dir: str | Path) -> str:
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def _template_path(mlflow_version: str) -> Path:
    from sparse_rl_mega.cache import cache_dir

    return cache_dir() / f"mlflow-{mlflow_version}-empty.db"


def seed_sqlite_store(tracking_uri: str) -> None:
    """A new local sqlite store starts as a copy of an empty one at this MLflow's schema: MLflow creates
    a store by running its schema migrations one by one (~1.5 s here), so they run once per machine and
    MLflow version (the template, in the user's cache) instead of once per run. Other URIs, and stores
    that exist already, are left to MLflow."""
    import mlflow

    if not tracking_uri.startswith("sqlite:///"):
        return
    target = Path(tracking_uri[len("sqlite:///"):])
    if target.exists():
        return
    template = _template_path(mlflow.__version__)
    if not template.is_file():
        template.parent.mkdir(parents=True, exist_ok=True)
        building = template.with_name(f"{template.name}.{os.getpid()}.tmp")
        migrations = logging.getLogger("mlflow.store.db.utils")  # (its INFO lines on the tables it creates)
        level, migrations.level = migrations.level, logging.WARNING
        try:
            mlflow.MlflowClient(tracking_uri=f"sqlite:///{building}").search_experiments()  # creates the tables
        finally:
            migrations.setLevel(level)
        os.replace(building, template)  # atomic: concurrent runs never see half a template
    shutil.copyfile(template, target)


class Tracker:
    """Thin wrapper over one MLflow run; a disabled tracker accepts the same calls and does nothing.

    ``resume_run_id`` (from a checkpoint) continues that run when it exists in this tracking store:
    metrics go on at the resumed steps, and the resuming config is logged as an extra artifact (its
    values may differ, e.g. another layout, and MLflow refuses to change a logged parameter)."""

    def __init__(self, cfg: RunConfig, enabled: bool = True, resume_run_id: Optional[str] = None):
        self.enabled = enabled and cfg.tracking.enabled
        self.run_id: Optional[str] = None
        self.continued = False
        if not self.enabled:
            return
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        os.environ.setdefault("DO_NOT_TRACK", "true")
        import mlflow

        self.mlflow = mlflow
        self.run_dir = run_dir = Path(cfg.trainer.run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = cfg.tracking.tracking_uri or default_tracking_uri(run_dir)
        seed_sqlite_store(self.tracking_uri)
        mlflow.set_tracking_uri(self.tracking_uri)
        experiment = mlflow.get_experiment_by_name(cfg.tracking.experiment)
        if experiment is None:
            artifacts = (run_dir / "mlartifacts").as_uri() if cfg.tracking.tracking_uri is None else None
            experiment_id = mlflow.create_experiment(cfg.tracking.experiment, artifact_location=artifacts)
        else:
            experiment_id = experiment.experiment_id
        config_text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        if resume_run_id is not None and self._exists(resume_run_id):
            run = mlflow.start_run(run_id=resume_run_id)
            self.run_id, self.continued, self.run_name = run.info.run_id, True, run.info.run_name
            mlflow.log_text(config_text, f"config_resumed_{run.info.end_time or 0}.yaml")
            return
        run = mlflow.start_run(experiment_id=experiment_id, run_name=cfg.tracking.run_name or default_run_name(cfg))
        self.run_id, self.run_name = run.info.run_id, run.info.run_name
        if resume_run_id is not None:
            mlflow.set_tag("resumed_from_run", resume_run_id)
        params = _flatten(cfg.to_dict())
        items = list(params.items())
        for start in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            mlflow.log_params(dict(items[start:start + 100]))
        mlflow.log_text(config_text, "config.yaml")

    def how_to_open(self) -> str:
        """One line: how to look at this run in MLflow's UI."""
        if self.tracking_uri != default_tracking_uri(self.run_dir):
            return f"MLflow run {self.run_name!r} ({self.run_id}) at {self.tracking_uri}"
        root = Path(__file__).resolve().parent.parent  # (where the Makefile is)
        if Path.cwd().resolve() == root and self.run_dir.is_relative_to(root):
            command = f"make mlflow-ui RUN={self.run_dir.relative_to(root)}"
        else:
            command = f"make -C {root} mlflow-ui RUN={self.run_dir}"
        return f"MLflow run {self.run_name!r}: {command}, then open http://127.0.0.1:5000"

    def _exists(self, run_id: str) -> bool:
        try:
            self.mlflow.get_run(run_id)
            return True
        except Exception:  # another tracking store: MLflow raises its own not-found error
            return False

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.enabled:
            clean = {k: float(v) for k, v in metrics.items()}
            self.mlflow.log_metrics(clean, step=step)

    def finish(self, status: str = "FINISHED") -> None:
        if self.enabled and self.run_id is not None:
            self.mlflow.end_run(status=status)
            self.run_id = None
