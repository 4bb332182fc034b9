"""A new local sqlite store is seeded from an empty store at MLflow's current schema (made once per
machine and MLflow version, in the user's cache) instead of running MLflow's migrations per run; the
seeded store works like one MLflow made itself."""
import sqlite3

import mlflow

from sparse_rl_mega.tracking import _template_path, seed_sqlite_store


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
