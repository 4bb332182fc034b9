"""A new local sqlite store is seeded from an empty store at MLflow's current schema (made once per
machine and MLflow version, in the user's cache) instead of running MLflow's migrations per run; the
seeded store works like one MLflow made itself."""
import sqlite3
import sys

import mlflow

from sparse_rl_mega.train.tracking import _template_path, seed_sqlite_store


def _schema(path):
    with sqlite3.connect(path) as db:
        tables = sorted(row[0] for row in db.execute("select name from sqlite_master where type='table'"))
        version = db.execute("select version_num from alembic_version").fetchall()
    return tables, version


def test_seeded_store_equals_a_fresh_one_and_works(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    seeded, fresh = tmp_path / "seeded.db", tmp_path / "fresh.db"
    seed_sqlite_store(f"sqlite:///{seeded}")
    assert _template_path(mlflow.__version__).is_file() and seeded.is_file()
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{fresh}").search_experiments()  # MLflow's own migrations
    assert _schema(seeded) == _schema(fresh) and _schema(seeded)[1]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{seeded}")
    run = client.create_run(client.create_experiment("e", artifact_location=(tmp_path / "a").as_uri()))
    client.log_metric(run.info.run_id, "m", 1.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "m")] == [(3, 1.5)]
    # an existing store and other URIs are left alone
    before = seeded.read_bytes()
    seed_sqlite_store(f"sqlite:///{seeded}")
    assert seeded.read_bytes() == before
    seed_sqlite_store("http://127.0.0.1:5000")


# ----------------------------------------------------------------- a tracking store that stops answering


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.time() + timeout_s
    while not predicate():
        assert time.time() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def test_metrics_wait_for_a_server_that_went_away_and_none_is_lost(tmp_path, monkeypatch):
    """A real ``mlflow server``: metrics go out while it answers; once it is gone, logging does not wait,
    one line says so, and the values wait in order in the run folder; at the end what is unsent stays in
    ``mlflow_unsent.jsonl`` with one line naming the way to send it, and tools/send_unsent_metrics.py
    sends it to the store (here the server's own sqlite store), every value at its step, the run ended.
    (A server that comes back during the run: the chaos trial of tests/test_overlap.py.)"""
    import time

    from sparse_rl_mega.config import load_config
    from sparse_rl_mega.train.tracking import UNSENT_FILE, Tracker
    from tests.conftest import ROOT, run_captured
    from sparse_rl_mega.studies.chaos import TrackingServer

    for proxy in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    server = TrackingServer(run_dir, tmp_path / "server.log")
    lines: list[str] = []
    cfg = load_config(ROOT / "examples" / "cpu_tiny.yaml", [f"trainer.run_dir={run_dir}",
                                                             f"tracking.tracking_uri={server.uri}"])
    try:
        tracker = Tracker(cfg, log=lines.append)
        run_id, unsent = tracker.run_id, run_dir / UNSENT_FILE
        tracker.log_metrics({"a": 0.5, "b": 1.0}, step=0)
        _wait_for(lambda: not tracker.queue.pending, "step 0 sent")
    finally:
        server.stop()  # gone for good (its keeper starts it again only after a kill)
    started = time.perf_counter()
    for step in (1, 2, 3):
        tracker.log_metrics({"a": step + 0.5, "b": step + 1.0}, step=step)
    assert time.perf_counter() - started < 0.5, "logging waited for the store"
    _wait_for(lambda: any("does not take metrics" in line for line in lines), "the line on the store")
    (down,) = [line for line in lines if "does not take metrics" in line]
    # (refused, or reset: the client's kept-alive connection to the server that went away)
    cause = "[Errno 104] Connection reset by peer" if "reset" in down else "[Errno 111] Connection refused"
    assert down == (f"[tracking] the MLflow store {server.uri} does not take metrics ({cause}): training "
                    f"goes on; metrics are kept in order ({unsent}) and sent when it answers again")
    assert '"step": 3' in unsent.read_text()
    line = tracker.finish(wait_s=1.0)
    assert line == (f"[tracking] the MLflow store {server.uri} still does not take metrics after 1 s: 6 values of steps "
                    f"1-3 (and the end of run {run_id}) not sent, kept in {unsent}; the next launch in this run folder "
                    f"sends them first, or: python tools/send_unsent_metrics.py {run_dir} --tracking-uri {server.uri}")
    assert len(unsent.read_text().splitlines()) == 4
    tool = [sys.executable, ROOT / "tools" / "send_unsent_metrics.py", run_dir]
    refused = run_captured(tool + ["--tracking-uri", server.uri], 120)  # still down: the file stays
    assert refused.returncode == 1 and "does not answer ([Errno 111] Connection refused)" in refused.stderr
    assert len(unsent.read_text().splitlines()) == 4
    store = f"sqlite:///{run_dir / 'mlflow.db'}"  # the server's store, reached without it
    sent = run_captured(tool + ["--tracking-uri", store], 120)
    assert sent.returncode == 0, sent.stderr[-2000:]
    assert sent.stdout == f"sent 6 values of steps 1-3 (and the end of run {run_id}) to {store}\n"
    assert not unsent.exists()
    client = mlflow.MlflowClient(tracking_uri=store)
    assert _history(client, run_id, "a") == [(0, 0.5), (1, 1.5), (2, 2.5), (3, 3.5)]
    assert _history(client, run_id, "b") == [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_the_next_launch_sends_what_an_earlier_job_left_unsent_first(tmp_path, monkeypatch):
    import json

    from sparse_rl_mega.config import load_config
    from sparse_rl_mega.train.tracking import UNSENT_FILE, Tracker
    from tests.conftest import ROOT

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = load_config(ROOT / "examples" / "cpu_tiny.yaml", [f"trainer.run_dir={tmp_path}"])
    first = Tracker(cfg)
    earlier = first.run_id
    first.finish()  # (its store answered; the file stands for what one that did not left behind)
    entries = [{"run_id": earlier, "step": 4, "timestamp": 1000, "metrics": {"a": 4.5}},
               {"run_id": earlier, "step": 5, "timestamp": 2000, "metrics": {"a": 5.5}},
               {"run_id": earlier, "status": "FAILED"}]
    (tmp_path / UNSENT_FILE).write_text("".join(json.dumps(e) + "\n" for e in entries) + '{"run_id": "cut')
    lines: list[str] = []
    second = Tracker(cfg, resume_run_id=earlier, log=lines.append)
    second.log_metrics({"a": 6.5}, step=6)
    assert second.finish() is None
    assert lines == [f"[tracking] 2 values of steps 4-5 (and the end of run {earlier}) left unsent by an earlier "
                     f"job ({tmp_path / UNSENT_FILE}): sending them first"]
    assert not (tmp_path / UNSENT_FILE).exists()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert _history(client, earlier, "a") == [(4, 4.5), (5, 5.5), (6, 6.5)]
    assert client.get_run(earlier).info.status == "FINISHED"  # (the resumed run's end comes last)


# ----------------------------------------------------------------- the UI a user opens


def test_make_mlflow_ui_is_one_process_that_answers(tmp_path, monkeypatch):
    """``make mlflow-ui`` serves the run folder's store from one process: MLflow's default (4 uvicorn
    workers and a job runner, each importing MLflow first) did not answer for minutes on a busy 2-core
    machine. The page and the API answer (bounded wait: a hang fails, the time is printed)."""
    import os
    import signal
    import subprocess
    import time
    import urllib.request

    import psutil

    from sparse_rl_mega.runtime.ports import free_port
    from tests.conftest import ROOT

    for proxy in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    client.create_experiment("e2e-test")
    port, log = free_port(), open(tmp_path / "ui.log", "w")
    ui = subprocess.Popen(["make", "-s", "mlflow-ui", f"RUN={tmp_path}", f"PORT={port}"], cwd=ROOT, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    started = time.perf_counter()
    try:
        deadline, page = time.time() + 120, None
        while page is None and time.time() < deadline and ui.poll() is None:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).status
            except OSError:
                time.sleep(0.2)
        assert page == 200, (tmp_path / "ui.log").read_text()[-2000:]
        print(f"mlflow-ui answered after {time.perf_counter() - started:.1f} s")
        search = urllib.request.Request(f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/search",
                                        data=b'{"max_results": 10}', headers={"Content-Type": "application/json"})
        assert b"e2e-test" in urllib.request.urlopen(search, timeout=10).read()
        pythons = [p.cmdline() for p in psutil.Process(ui.pid).children(recursive=True) if "python" in p.name()]
        assert len(pythons) == 1, pythons
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=30)
        log.close()
