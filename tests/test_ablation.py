"""tools/ablation.py: naive, sparse_rl and dense variants of one config, launched as a user runs the tool
(tiny model, 2 iterations each), compared from one MLflow store. Same seeds and weights: the first
rollout of the two sparse variants is the same; dense rollouts have no sampler/learner mismatch beyond
float noise; the uncorrected variant rejects nothing; the table is computed from the logged metrics."""
import json
import sys
from types import SimpleNamespace

import mlflow
import pytest

from tests.conftest import ROOT, run_captured, write_test_config
from tools.ablation import plan, variant_overrides


def test_variants_are_validated_before_anything_starts(tmp_path, tiny_model_dir):
    config = write_test_config(tmp_path / "a.yaml", tiny_model_dir, tmp_path / "run")
    with pytest.raises(ValueError, match="unknown variant 'magic'"):
        variant_overrides("magic")
    proc = run_captured([sys.executable, ROOT / "tools" / "ablation.py", config, "--variants", "naive,dense",
                         "--set", "trainer.lr=fast", "--out", tmp_path / "out"], 60)
    assert proc.returncode == 2 and "trainer.lr" in proc.stderr and not (tmp_path / "out").exists()

    args = SimpleNamespace(config=str(config), variants="naive,sparse_rl", iterations=2, overrides=[],
                           tracking_uri=None, out=tmp_path / "o")
    out, runs = plan(args)
    assert runs["naive"][-1] == "trainer.iterations=2" and "algorithm.correction.preset=naive" in runs["naive"]


def test_ablation_compares_naive_sparse_rl_and_dense(tmp_path, tiny_model_dir):
    config = write_test_config(tmp_path / "ablation.yaml", tiny_model_dir, tmp_path / "unused")
    out = tmp_path / "ablation"
    proc = run_captured([sys.executable, ROOT / "tools" / "ablation.py", config, "--iterations", "2",
                         "--out", out, "--set", "checkpoint.save_interval=0"], 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert (out / "ablation.png").stat().st_size > 5000
    result = json.loads((out / "ablation.json").read_text())
    rows = {row["variant"]: row for row in result["rows"]}
    assert sorted(rows) == ["dense", "naive", "sparse_rl"]
    assert len((out / "ablation.md").read_text().splitlines()) == 2 + 3

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")

    def history(variant, key):
        return {m.step: m.value for m in client.get_metric_history(result["variants"][variant]["run_id"], key)}

    for variant in rows:
        assert sorted(history(variant, "reward/mean")) == [0, 1]
        assert rows[variant]["reward_first"] == history(variant, "reward/mean")[0]
    # same seeds, same initial weights, same eviction: the first rollout of both sparse variants agrees
    for key in ("reward/mean", "kv/evicted_tokens", "rollout/response_len_mean", "mismatch/k3"):
        assert history("naive", key)[0] == history("sparse_rl", key)[0], key
    assert history("naive", "kv/evicted_tokens")[0] > 0 and history("dense", "kv/evicted_tokens")[0] == 0
    # dense rollouts: sampler = learner up to float noise; sparse ones: a real mismatch
    assert history("dense", "mismatch/k3")[0] < 1e-4 < history("naive", "mismatch/k3")[0]
    assert all(v == 0 for v in history("naive", "correction/token_rejected_fraction").values())
    assert rows["naive"]["token_rejected_mean"] == 0
