"""MLflow tracking (rank 0 only): a local sqlite store inside the run folder unless a tracking URI is
configured; the whole resolved config is logged as parameters and as a YAML artifact.

Metrics never wait for the tracking store: :meth:`Tracker.log_metrics` queues them and a thread sends
them in the order logged. While the store does not answer (a tracking server that went away) training
goes on, one line says so, the values wait in that queue and in ``<run_dir>/mlflow_unsent.jsonl``
(so that a killed job loses none of them), and are sent when it answers again, with one line on what
was sent late. What is still unsent when the job ends stays in that file: the next launch in the run
folder sends it first, or ``tools/send_unsent_metrics.py RUN_DIR`` does."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections import deque
from pathlib import Path
from typing import Optional
from collections.abc import Callable

import yaml

from sparse_rl_mega.config import RunConfig
from sparse_rl_mega.runtime.cache import cache_dir
from sparse_rl_mega.runtime.paths import ROOT


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


RUN_RECORD = "mlflow_run.json"  # in the run folder: the MLflow run the newest job there logs to
UNSENT_FILE = "mlflow_unsent.jsonl"  # in the run folder: values logged that the store has not taken yet
RETRY_MAX_S = 15.0  # the longest wait between two tries to reach a store that does not answer
# one try of an HTTP request to a tracking server: MLflow's own defaults (7 retries, backoff factor 2,
# 120 s timeout) would take minutes to say that a server is down; the sender retries by itself
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                        "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def why_unreachable(exc: BaseException) -> str:
    """The cause in a few words (``[Errno 111] Connection refused``), from the innermost exception
    behind MLflow's and urllib3's wrappers, whose messages nest every layer's."""
    inner, seen = exc, 0
    while (inner.__cause__ or inner.__context__) is not None and seen < 10:
        inner, seen = inner.__cause__ or inner.__context__, seen + 1
    text = str(inner)
    found = re.search(r"\[Errno -?\d+\][^'\"),]*", text)
    if found:
        return found.group(0).strip()
    found = re.search(r"\w+Error\((\d+), '([^']+)'\)", text)  # (urllib3 quotes an OSError by its repr)
    if found:
        return f"[Errno {found.group(1)}] {found.group(2)}"
    if inner is exc:
        return (text.strip().splitlines() or [type(exc).__name__])[0][:200]
    return f"{type(inner).__name__}: {text.strip()[:160]}" if text.strip() else type(inner).__name__


class MetricQueue:
    """Values logged for MLflow runs, sent in the order logged by one thread; while the store does not
    answer they wait, in memory and in ``unsent_path`` (rewritten as values are added), and go out when
    it answers again. One entry: ``{"run_id", "step", "timestamp" (ms), "metrics": {name: value}}``;
    ``{"run_id", "status"}`` ends a run (MLflow's ``set_terminated``)."""

    def __init__(self, client, tracking_uri: str, unsent_path: Path, log: Callable[[str], None]):
        self.client, self.tracking_uri, self.unsent_path, self.log = client, tracking_uri, unsent_path, log
        self.pending: deque[dict] = deque()
        self.changed = threading.Condition()
        self.down_since: Optional[float] = None  # when a send first failed (None: the store answers)
        self.sent_late: list[dict] = []  # entries sent since the store answers again
        self.closing = False
        if unsent_path.is_file():  # left by an earlier job in this folder: they go first
            self.pending.extend(read_unsent(unsent_path))
            if self.pending:
                self.log(f"[tracking] {describe(self.pending)} left unsent by an earlier job ({unsent_path}): "
                         f"sending them first")
        self.thread = threading.Thread(target=self._send_forever, daemon=True, name="mlflow-sender")
        self.thread.start()

    def put(self, entry: dict) -> None:
        with self.changed:
            self.pending.append(entry)
            if self.down_since is not None:
                self._keep_unsent()
            self.changed.notify_all()

    def _send_forever(self) -> None:
        backoff = 1.0
        while True:
            with self.changed:
                while not self.pending and not self.closing:
                    self.changed.wait()
                if not self.pending:
                    return
                entry = self.pending[0]
            try:
                send_entry(self.client, entry)
            except Exception as exc:  # noqa: BLE001 (the store does not answer or refuses: kept, tried again later)
                with self.changed:
                    if self.down_since is None:
                        self.down_since = time.time()
                        self._keep_unsent()
                        self.log(f"[tracking] the MLflow store {self.tracking_uri} does not take metrics "
                                 f"({why_unreachable(exc)}): training goes on; metrics are kept in order "
                                 f"({self.unsent_path}) and sent when it answers again")
                    self.changed.wait(backoff)  # (woken early by new values or by the job's end)
                backoff = min(2 * backoff, RETRY_MAX_S)
                continue
            backoff = 1.0
            with self.changed:
                self.pending.popleft()
                if self.down_since is not None:
                    self.sent_late.append(entry)
                    if self.pending:
                        self._keep_unsent()
                    else:
                        self.unsent_path.unlink(missing_ok=True)
                        self.log(f"[tracking] the MLflow store {self.tracking_uri} answers again after "
                                 f"{time.time() - self.down_since:.0f} s: sent {describe(self.sent_late)} late")
                        self.down_since, self.sent_late = None, []
                elif self.unsent_path.is_file() and not self.pending:
                    self.unsent_path.unlink(missing_ok=True)  # (an earlier job's values, all sent now)
                self.changed.notify_all()

    def _keep_unsent(self) -> None:
        """(lock held) Rewrite ``unsent_path`` with every value not sent yet."""
        write_unsent(self.unsent_path, self.pending)

    def close(self, wait_s: float) -> Optional[str]:
        """Send what is queued, waiting at most ``wait_s`` for a store that does not answer; returns None
        when everything went, else the line that says what stays in ``unsent_path``."""
        deadline = time.monotonic() + wait_s
        with self.changed:
            self.closing = True
            self.changed.notify_all()
            while self.pending and time.monotonic() < deadline:
                self.changed.wait(min(1.0, max(deadline - time.monotonic(), 0.0)))
            if not self.pending:
                return None
            self._keep_unsent()
            run_dir = self.unsent_path.parent
            uri = "" if self.tracking_uri == default_tracking_uri(run_dir) else f" --tracking-uri {self.tracking_uri}"
            return (f"[tracking] the MLflow store {self.tracking_uri} still does not take metrics after {wait_s:.0f} s: "
                    f"{describe(self.pending)} not sent, kept in {self.unsent_path}; the next launch in this run "
                    f"folder sends them first, or: python tools/send_unsent_metrics.py {run_dir}{uri}")


def send_entry(client, entry: dict) -> None:
    """One queue entry to the store (raises when it does not answer)."""
    from mlflow.entities import Metric

    if "status" in entry:
        client.set_terminated(entry["run_id"], entry["status"])
        return
    values = [Metric(key, value, entry["timestamp"], entry["step"]) for key, value in entry["metrics"].items()]
    for start in range(0, len(values), 1000):  # MLflow's limit per batch
        client.log_batch(entry["run_id"], metrics=values[start:start + 1000], synchronous=True)


def write_unsent(path: Path, entries) -> None:
    """Queue entries as an unsent-metrics file, one JSON line each (atomic: a killed job leaves the old
    file or the new one)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    os.replace(partial, path)


def bound_http_requests() -> None:
    """MLflow's client makes one bounded try per request (:data:`MLFLOW_HTTP_DEFAULTS`) unless the user
    set its variables."""
    for name, value in MLFLOW_HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)


def read_unsent(path: Path) -> list[dict]:
    """The entries of an unsent-metrics file, in order (a line cut by a killed job is skipped)."""
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    return entries


def describe(entries) -> str:
    """``37 values of steps 3-5 (and the end of run abc)`` for a list of queue entries."""
    values = sum(len(e.get("metrics", {})) for e in entries)
    steps = [e["step"] for e in entries if "step" in e]
    span = "" if not steps else f" of step {steps[0]}" if min(steps) == max(steps) else \
        f" of steps {min(steps)}-{max(steps)}"
    ends = [e["run_id"] for e in entries if "status" in e]
    return f"{values} values{span}" + (f" (and the end of run {', '.join(ends)})" if ends else "")


class Tracker:
    """One MLflow run; a disabled tracker accepts the same calls and does nothing. Metrics go through a
    :class:`MetricQueue` (they never wait for the store); :meth:`finish` sends what is left.

    ``resume_run_id`` (from a checkpoint) continues that run when it exists in this tracking store:
    metrics go on at the resumed steps, and the resuming config is logged as an extra artifact (its
    values may differ, e.g. another layout, and MLflow refuses to change a logged parameter)."""

    def __init__(self, cfg: RunConfig, enabled: bool = True, resume_run_id: Optional[str] = None,
                 log: Callable[[str], None] = print):
        self.enabled = enabled and cfg.tracking.enabled
        self.run_id: Optional[str] = None
        self.continued = False
        self.queue: Optional[MetricQueue] = None
        if not self.enabled:
            return
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        os.environ.setdefault("DO_NOT_TRACK", "true")
        bound_http_requests()
        import mlflow
        from mlflow.tracking.context.registry import resolve_tags

        self.flush_timeout_s = cfg.tracking.flush_timeout_s
        self.run_dir = run_dir = Path(cfg.trainer.run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = cfg.tracking.tracking_uri or default_tracking_uri(run_dir)
        seed_sqlite_store(self.tracking_uri)
        # the client alone, no fluent active run: MLflow would end that at exit, waiting on a store that
        # may not answer
        self.client = client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(cfg.tracking.experiment)
        if experiment is None:
            artifacts = (run_dir / "mlartifacts").as_uri() if cfg.tracking.tracking_uri is None else None
            experiment_id = client.create_experiment(cfg.tracking.experiment, artifact_location=artifacts)
        else:
            experiment_id = experiment.experiment_id
        config_text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        line = end_left_running(run_dir, "KILLED", keep=resume_run_id)
        if line:
            log(line)
        if resume_run_id is not None and self._exists(resume_run_id):
            run = client.get_run(resume_run_id)
            client.update_run(resume_run_id, status="RUNNING")
            self.run_id, self.continued, self.run_name = resume_run_id, True, run.info.run_name
            client.log_text(self.run_id, config_text, f"config_resumed_{run.info.end_time or 0}.yaml")
        else:
            tags = {"resumed_from_run": resume_run_id} if resume_run_id is not None else {}
            run = client.create_run(experiment_id, tags=resolve_tags(tags),
                                    run_name=cfg.tracking.run_name or default_run_name(cfg))
            self.run_id, self.run_name = run.info.run_id, run.info.run_name
            from mlflow.entities import Param

            params = [Param(key, value) for key, value in _flatten(cfg.to_dict()).items()]
            for start in range(0, len(params), 100):  # MLflow caps a batch at 100 params
                client.log_batch(self.run_id, params=params[start:start + 100])
            client.log_text(self.run_id, config_text, "config.yaml")
        write_run_record(run_dir, self.run_id, self.tracking_uri)
        self.queue = MetricQueue(client, self.tracking_uri, run_dir / UNSENT_FILE, log)

    def how_to_open(self) -> str:
        """One line: how to look at this run in MLflow's UI."""
        if self.tracking_uri != default_tracking_uri(self.run_dir):
            return f"MLflow run {self.run_name!r} ({self.run_id}) at {self.tracking_uri}"
        if Path.cwd().resolve() == ROOT and self.run_dir.is_relative_to(ROOT):
            command = f"make mlflow-ui RUN={self.run_dir.relative_to(ROOT)}"
        else:
            command = f"make -C {ROOT} mlflow-ui RUN={self.run_dir}"
        return f"MLflow run {self.run_name!r}: {command}, then open http://127.0.0.1:5000"

    def _exists(self, run_id: str) -> bool:
        """Whether the store holds that run (False for another store's run; a store that does not
        answer raises)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``metrics`` at ``step`` (sent in order by the queue's thread; never waits)."""
        if self.enabled:
            self.queue.put({"run_id": self.run_id, "step": int(step), "timestamp": int(time.time() * 1000),
                            "metrics": {k: float(v) for k, v in metrics.items()}})

    def finish(self, status: str = "FINISHED", wait_s: Optional[float] = None) -> Optional[str]:
        """End the run: what is queued goes first, then the run's status; waits at most ``wait_s``
        (default ``tracking.flush_timeout_s``) for a store that does not answer. Returns None when all
        was sent, else the line that says what stays in ``<run_dir>/mlflow_unsent.jsonl``."""
        if not self.enabled or self.run_id is None:
            return None
        self.queue.put({"run_id": self.run_id, "status": status})
        self.run_id = None
        return self.queue.close(self.flush_timeout_s if wait_s is None else wait_s)


def write_run_record(run_dir: Path, run_id: str, tracking_uri: str) -> None:
    """Name the run this job logs to in ``<run_dir>/mlflow_run.json`` (atomic), for whoever must end it
    when this job cannot: its launcher after the ranks were stopped, or the next job in this folder."""
    partial = run_dir / f"{RUN_RECORD}.partial"
    partial.write_text(json.dumps({"run_id": run_id, "tracking_uri": tracking_uri}) + "\n")
    os.replace(partial, run_dir / RUN_RECORD)


def end_left_running(run_dir: str | Path, status: str, keep: Optional[str] = None) -> Optional[str]:
    """End the run ``<run_dir>/mlflow_run.json`` names with ``status`` (``KILLED``, ``FAILED``) if it is
    still RUNNING: its job ended without ending it (killed ranks, a killed launcher). ``keep``: a run
    the caller continues (a resume), left as it is. Returns the line that says what was done (None
    when nothing was left running); a store that does not answer is said in that line, not raised."""
    import mlflow

    path = Path(run_dir) / RUN_RECORD
    try:
        record = json.loads(path.read_text())
        run_id, uri = record["run_id"], record["tracking_uri"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if run_id == keep:
        return None
    bound_http_requests()
    try:
        client = mlflow.MlflowClient(tracking_uri=uri)
        run = client.get_run(run_id)
        if run.info.status != "RUNNING":
            return None
        client.set_terminated(run_id, status)
    except Exception as exc:  # noqa: BLE001 (the store is gone or refuses: said, the job goes on)
        return (f"[tracking] could not end MLflow run {run_id} at {uri}, left RUNNING by a job that ended without "
                f"ending it ({why_unreachable(exc)})")
    return f"[tracking] MLflow run {run.info.run_name!r} ({run_id}) was left RUNNING by its job: ended as {status}"


def send_unsent(run_dir: Path, tracking_uri: Optional[str] = None) -> str:
    """Send ``<run_dir>/mlflow_unsent.jsonl`` to ``tracking_uri`` (default: the sqlite store in the run
    folder); removes the file once everything went. Returns what was sent;
    raises when the store does not answer (the file is kept)."""
    import mlflow

    path = Path(run_dir) / UNSENT_FILE
    if not path.is_file():
        return f"nothing to send: no {path}"
    entries = read_unsent(path)
    uri = tracking_uri or default_tracking_uri(run_dir)
    bound_http_requests()
    client = mlflow.MlflowClient(tracking_uri=uri)
    for n, entry in enumerate(entries):
        try:
            send_entry(client, entry)
        except Exception as exc:  # noqa: BLE001 (whatever the client raised: one line)
            raise RuntimeError(f"the MLflow store {uri} does not answer ({why_unreachable(exc)}): sent "
                               f"{describe(entries[:n])}, {describe(entries[n:])} still in {path}") from None
        write_unsent(path, entries[n + 1:])  # (a second try sends no value twice)
    path.unlink()
    return f"sent {describe(entries)} to {uri}"
