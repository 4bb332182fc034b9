"""tools/ablation.py: naive and sparse_rl variants of one config, launched as a user runs the tool
(tiny model, 1 iteration each), compared from one MLflow store. Same seeds and weights: the first
rollout of the two sparse variants is the same; the uncorrected variant rejects nothing, the
corrected one does; the table is computed from the logged metrics. The dense variant's override is
checked without a launch (dense rollouts against the learner: tests/test_e2e.py, test_engine_kv.py)."""
import json
from types import SimpleNamespace

import mlflow
import pytest

from tests.conftest import ROOT, run_tool, write_test_config
from tools.ablation import plan, ratio_with_stderr, variant_overrides

# one learner process per variant (the layouts are tests/test_layout_invariance.py's; here the variants)
ONE_PROCESS = ["--set", "checkpoint.save_interval=0", "--set", "parallel.nproc_per_node=1",
               "--set", "parallel.pipeline_model_parallel_size=1"]


def test_variants_are_validated_before_anything_starts(tmp_path, tiny_model_dir):
    config = write_test_config(tmp_path / "a.yaml", tiny_model_dir, tmp_path / "run")
    with pytest.raises(ValueError, match="unknown variant 'magic'"):
        variant_overrides("magic")
    proc = run_tool(ROOT / "tools" / "ablation.py", config, "--variants", "naive,dense",
                    "--set", "trainer.lr=fast", "--out", tmp_path / "out", timeout=60)
    assert proc.returncode == 2 and "trainer.lr" in proc.stderr and not (tmp_path / "out").exists()

    args = SimpleNamespace(config=str(config), variants="naive,sparse_rl", iterations=2, overrides=[],
                           tracking_uri=None, out=tmp_path / "o")
    out, runs, iterations = plan(args)
    assert runs["naive"][-1] == "trainer.iterations=2" and "algorithm.correction.preset=naive" in runs["naive"]
    assert iterations == {"naive": 2, "sparse_rl": 2}


@pytest.mark.unit
def test_accuracy_ratio_and_its_standard_error():
    """The delta-method standard error, checked against its expanded form
    var(r) = (var(x) - 2 r cov(x, y) + r^2 var(y)) / (n mean(y)^2)."""
    x = [1.0, 0.75, 0.5, 1.0, 0.25, 0.75, 1.0, 0.5]
    y = [1.0, 1.0, 0.5, 0.75, 0.5, 0.75, 1.0, 0.25]
    n, mx, my = len(x), sum(x) / len(x), sum(y) / len(y)
    cov = lambda a, ma, b, mb: sum((u - ma) * (v - mb) for u, v in zip(a, b)) / (n - 1)  # noqa: E731
    r = mx / my
    expected = ((cov(x, mx, x, mx) - 2 * r * cov(x, mx, y, my) + r * r * cov(y, my, y, my)) / n) ** 0.5 / my
    ratio, stderr = ratio_with_stderr(x, y)
    assert ratio == pytest.approx(r) and stderr == pytest.approx(expected, rel=1e-12)
    assert ratio_with_stderr(y, y) == (1.0, 0.0)
    with pytest.raises(ValueError, match="paired"):
        ratio_with_stderr(x, y[:-1])


def test_ablation_compares_naive_and_sparse_rl(tmp_path, tiny_model_dir):
    assert variant_overrides("dense") == ["rollout.kv_compression.policy=none"]
    config = write_test_config(tmp_path / "ablation.yaml", tiny_model_dir, tmp_path / "unused")
    out = tmp_path / "ablation"
    proc = run_tool(ROOT / "tools" / "ablation.py", config, "--variants", "naive,sparse_rl",
                    "--iterations", "1", "--out", out, *ONE_PROCESS, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert (out / "ablation.png").stat().st_size > 5000
    result = json.loads((out / "ablation.json").read_text())
    rows = {row["variant"]: row for row in result["rows"]}
    assert sorted(rows) == ["naive", "sparse_rl"]
    assert len((out / "ablation.md").read_text().splitlines()) == 2 + 2

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")

    def history(variant, key):
        return {m.step: m.value for m in client.get_metric_history(result["variants"][variant]["run_id"], key)}

    for variant in rows:
        assert sorted(history(variant, "reward/mean")) == [0]
        assert rows[variant]["reward_first"] == history(variant, "reward/mean")[0]
    # same seeds, same initial weights, same eviction: the first rollout of both sparse variants agrees
    for key in ("reward/mean", "kv/evicted_tokens", "rollout/response_len_mean", "mismatch/k3"):
        assert history("naive", key)[0] == history("sparse_rl", key)[0], key
    assert history("naive", "kv/evicted_tokens")[0] > 0 and history("naive", "mismatch/k3")[0] > 1e-4
    # the correction differs: naive rejects nothing, sparse_rl rejects tokens of the same rollout
    assert history("naive", "correction/token_rejected_fraction")[0] == 0 and rows["naive"]["token_rejected_mean"] == 0
    assert history("sparse_rl", "correction/token_rejected_fraction")[0] > 0

    # the same command again: both variants finished, nothing is launched, the summary is rewritten
    again = run_tool(ROOT / "tools" / "ablation.py", config, "--variants", "naive,sparse_rl",
                     "--iterations", "1", "--out", out, *ONE_PROCESS, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("finished in") == 2 and "tools/launch.py" not in again.stdout
    assert json.loads((out / "ablation.json").read_text())["rows"] == result["rows"]
