"""tools/ablation.py: naive and sparse_rl variants of one config, launched as a user runs the tool
(tiny model, 1 iteration each), compared from one MLflow store. Same seeds and weights: the first
rollout of the two sparse variants is the same; the uncorrected variant rejects nothing, the
corrected one does; the table is computed from the logged metrics. The dense variant's override is
checked without a launch (dense rollouts against the learner: tests/test_e2e.py, test_engine_kv.py)."""
import json
import re
from types import SimpleNamespace

import mlflow
import pytest

from tests.conftest import ROOT, TRAIN_DATA, run_tool, write_test_config
from sparse_rl_mega.config import load_config
from sparse_rl_mega.studies.statistics import base_variant, held_out, ratio_with_stderr, summarize
from sparse_rl_mega.studies.ablation import plan, variant_overrides
from sparse_rl_mega.studies.plots import CURVES, plot_budget_map

# one learner process per variant (the layouts are tests/test_layout_invariance.py's; here the variants)
ONE_PROCESS = ["--set", "checkpoint.save_interval=0", "--set", "parallel.nproc_per_node=1",
               "--set", "parallel.pipeline_model_parallel_size=1"]
FIXED_BUDGET = "rollout.kv_compression.auto_budget=null"  # the test config's budget is automatic (conftest)


def test_variants_are_validated_before_anything_starts(tmp_path, tiny_model_dir):
    config = write_test_config(tmp_path / "a.yaml", tiny_model_dir, tmp_path / "run")
    with pytest.raises(ValueError, match="unknown variant 'magic'"):
        variant_overrides("magic")
    proc = run_tool(ROOT / "tools" / "ablation.py", config, "--variants", "naive,dense",
                    "--set", "trainer.lr=fast", "--out", tmp_path / "out", timeout=60)
    assert proc.returncode == 2 and "trainer.lr" in proc.stderr and not (tmp_path / "out").exists()

    args = SimpleNamespace(config=str(config), variants="naive,sparse_rl", iterations=2, overrides=[FIXED_BUDGET],
                           tracking_uri=None, out=tmp_path / "o")
    out, runs, iterations = plan(args)
    assert runs["naive"][-1] == "trainer.iterations=2" and "algorithm.correction.preset=naive" in runs["naive"]
    assert iterations == {"naive": 2, "sparse_rl": 2}
    # a config that evaluates: every variant dense and under the rollout's compression (the dense one too)
    evaluated = write_test_config(tmp_path / "e.yaml", tiny_model_dir, tmp_path / "run",
                                  f"eval: {{path: {TRAIN_DATA}, kv: dense}}")
    args.config, args.variants = str(evaluated), "naive,dense"
    _, runs, _ = plan(args)
    assert all(overrides[0] == "eval.kv=dense,rkv:12" for overrides in runs.values())

    # the budget map: each sparse variant per budget, dense once (evaluated under every budget's
    # compression), the automatic budget within the sweep's bounds, from the largest
    args.variants, args.overrides, args.budgets, args.auto = "naive,sparse_rl,dense", [], "16,12", "sparse_rl"
    _, runs, _ = plan(args)
    assert list(runs) == ["naive_b12", "naive_b16", "sparse_rl_auto", "sparse_rl_b12", "sparse_rl_b16", "dense"]
    assert runs["naive_b16"][0] == "eval.kv=dense,rkv:16" and "rollout.kv_compression.budget=16" in runs["naive_b16"]
    assert runs["dense"][0] == "eval.kv=dense,rkv:12,rkv:16"
    assert runs["sparse_rl_auto"][0] == "eval.kv=dense,rollout"  # (the budget in force: 'rkv:auto')
    fixed = load_config(evaluated, runs["sparse_rl_b16"]).rollout.kv_compression
    assert (fixed.budget, fixed.auto_budget) == (16, None)
    auto = load_config(evaluated, runs["sparse_rl_auto"]).rollout.kv_compression
    assert (auto.budget, auto.auto_budget.min, auto.auto_budget.max) == (16, 12, 16)
    # a field of the automatic budget set by the user on a config with a fixed one is read with the sweep's bounds
    args.overrides = [FIXED_BUDGET, "rollout.kv_compression.auto_budget.decrease=3"]
    _, runs, _ = plan(args)
    assert load_config(evaluated, runs["sparse_rl_auto"]).rollout.kv_compression.auto_budget.decrease == 3
    args.overrides = []
    for budgets, auto_variants, message in [("16,12", "dense", "--auto 'dense'"), (None, "sparse_rl", "--auto needs"),
                                            ("12,x", None, "--budgets '12,x'"), ("12", "sparse_rl", "--auto needs")]:
        args.budgets, args.auto = budgets, auto_variants
        with pytest.raises(ValueError, match=re.escape(message)):
            plan(args)


@pytest.mark.unit
def test_budget_map_figure(tmp_path):
    """The map draws a curve per variant through its budgets and the automatic run as a point, from the
    summary's rows; nothing without held-out ratios."""
    rows = [{"variant": name, "peak_kv_fraction": peak, "budget_mean": budget}
            for name, peak, budget in [("naive_b32", 0.5, 32), ("naive_b56", 0.8, 56), ("sparse_rl_b32", 0.5, 32),
                                       ("sparse_rl_b56", 0.8, 56), ("sparse_rl_auto", 0.6, 40.5), ("dense", 1.0, float("nan"))]]
    accuracy = [{"variant": r["variant"], "setting": "dense", "after": 0.5, "after_stderr": 0.03,
                 "ratio_to_dense": 0.8, "ratio_stderr": 0.03} for r in rows if r["variant"] != "dense"]
    accuracy += [{"variant": r["variant"], "setting": "rkv:x", "after": 0.4, "after_stderr": 0.03} for r in rows]
    assert [base_variant(r["variant"]) for r in rows] == ["naive", "naive", "sparse_rl", "sparse_rl", "sparse_rl", "dense"]
    assert base_variant("sparse_rl_bx") == "sparse_rl_bx"
    assert plot_budget_map(rows, accuracy, tmp_path / "map.png") and (tmp_path / "map.png").stat().st_size > 5000
    assert not plot_budget_map(rows, [], tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def test_seeds_run_every_variant_per_seed_and_pair_each_with_its_own_dense(tmp_path, tiny_model_dir):
    """--seeds: one run per variant and seed (seed after seed), trainer.seed and data.seed set; each
    seed's held-out ratio is against the dense run of the same seed; the summary's means over seeds and
    their standard error across seeds, computed here by hand; a bad --seeds is one line."""
    from sparse_rl_mega.studies.statistics import over_seeds
    from sparse_rl_mega.studies.ablation import parse_seeds

    config = write_test_config(tmp_path / "s.yaml", tiny_model_dir, tmp_path / "run",
                               f"eval: {{path: {TRAIN_DATA}, kv: dense}}")
    args = SimpleNamespace(config=str(config), variants="naive,dense", iterations=2, overrides=[FIXED_BUDGET],
                           tracking_uri=None, out=tmp_path / "o", seeds="3,1")
    _, runs, _ = plan(args)
    assert list(runs) == ["naive_s3", "dense_s3", "naive_s1", "dense_s1"]
    cfg = load_config(config, runs["naive_s1"])
    assert (cfg.trainer.seed, cfg.data.seed, cfg.trainer.run_dir) == (1, 1, str(tmp_path / "o" / "naive_s1"))
    for bad in ("1,1", "x", ""):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)

    def evaluation(correct):  # correct samples of 4 per problem, one KV setting
        return {"iteration": 2, "results": {"rkv:12": {"mean_at_k": sum(correct) / (4 * len(correct)),
                                                       "samples_per_problem": 4, "correct_per_problem": correct}}}
    data = {"naive_s1": {"eval": [evaluation([2, 2])]}, "dense_s1": {"eval": [evaluation([4, 4])]},
            "naive_s2": {"eval": [evaluation([1, 3])]}, "dense_s2": {"eval": [evaluation([2, 2])]}}
    rows = {(r["variant"], r["setting"]): r for r in held_out(data)}
    assert rows[("naive_s1", "rkv:12")]["ratio_to_dense"] == pytest.approx(0.5)  # 0.5 / 1.0: seed 1's dense
    assert rows[("naive_s2", "rkv:12")]["ratio_to_dense"] == pytest.approx(1.0)  # 0.5 / 0.5: seed 2's
    merged = {(r["variant"], r["setting"]): r for r in over_seeds(held_out(data))}
    naive = merged[("naive", "rkv:12")]
    assert naive["seeds"] == 2 and naive["after"] == pytest.approx(0.5) and naive["after_stderr_seeds"] == 0.0
    assert naive["ratio_to_dense"] == pytest.approx(0.75)
    assert naive["ratio_to_dense_stderr_seeds"] == pytest.approx(((0.25 ** 2 * 2) / 1 / 2) ** 0.5)
    assert merged[("dense", "rkv:12")]["after"] == pytest.approx(0.75)
    assert over_seeds(held_out({"naive": data["naive_s1"], "dense": data["dense_s1"]})) == []


@pytest.mark.unit
def test_training_metrics_over_seeds():
    """The summary's training table over seeds: per variant, each metric's mean and its standard error
    across seeds (by hand: k3 0.2 and 0.4 -> 0.300 +- 0.100), a metric one seed did not log (NaN) left
    out of its mean, runs without a seed not merged; a dense run's peak KV is all of dense."""
    from sparse_rl_mega.studies.statistics import training_over_seeds

    rows = [{"variant": "naive_s1", "iterations": 3, "k3_mean": 0.2, "veto_mean": float("nan")},
            {"variant": "naive_s2", "iterations": 3, "k3_mean": 0.4, "veto_mean": 0.5},
            {"variant": "dense", "iterations": 3, "k3_mean": 0.0, "veto_mean": 0.0}]
    assert training_over_seeds(rows) == [{"variant": "naive", "seeds": 2, "k3_mean": "0.300 +- 0.100",
                                          "veto_mean": "0.500"}]
    empty = {"curves": {key: {} for key in CURVES} | {"reward/mean": {0: 0.5}}, "eval": []}
    rows, _, table = summarize({"dense_s1": empty, "naive_s1": empty})
    assert [row["peak_kv_fraction"] for row in rows] == [1.0, pytest.approx(float("nan"), nan_ok=True)]
    assert "Training metrics over seeds" in table


@pytest.mark.unit
def test_seeded_runs_are_drawn_as_their_mean_over_seeds(tmp_path):
    """The figure with seeds: one line per variant (seeds merged; runs without a seed beside them stay
    apart only when no run has one), at each iteration the mean over the seeds that logged it and the
    standard error across them (by hand: 0.2 and 0.4 -> 0.3 +- 0.1; a step one seed lacks: that seed's
    value alone, s.e. 0); the figure is written."""
    from sparse_rl_mega.studies.statistics import mean_curve, plot_groups
    from sparse_rl_mega.studies.plots import plot

    assert plot_groups({"naive_s1": {}, "dense_s1": {}, "naive_s2": {}}) == {"naive": ["naive_s1", "naive_s2"],
                                                                          "dense": ["dense_s1"]}
    assert plot_groups({"naive": {}, "sparse_rl_b32": {}}) == {"naive": ["naive"], "sparse_rl_b32": ["sparse_rl_b32"]}
    steps, mean, stderr = mean_curve([{0: 0.2, 1: 0.5}, {0: 0.4}])
    assert steps == [0, 1] and mean == pytest.approx([0.3, 0.5]) and stderr == pytest.approx([0.1, 0.0])

    def run(reward: float, correct: list[int]) -> dict:
        evaluation = {"iteration": 2, "results": {"dense": {"mean_at_k": sum(correct) / 8, "mean_at_k_stderr": 0.1,
                                                            "correct_per_problem": correct}}}
        return {"curves": {key: {0: reward, 1: reward} for key in CURVES}, "eval": [evaluation]}
    plot({"naive_s1": run(0.2, [1, 3]), "naive_s2": run(0.4, [2, 2]), "dense_s1": run(0.5, [4, 4])},
         tmp_path / "ablation.png")
    assert (tmp_path / "ablation.png").stat().st_size > 10_000


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


@pytest.mark.unit
def test_held_out_table_pairs_variants_and_settings():
    """Each variant under each KV setting of its last evaluation: the ratio to the dense variant under
    the same setting (paired per problem) and the drop from its own dense decoding, mean and standard
    error of the per-problem differences, computed here from the counts by hand."""
    def evaluation(iteration, dense, sparse):  # correct samples of 4 per problem
        row = lambda c: {"mean_at_k": sum(c) / (4 * len(c)), "samples_per_problem": 4,  # noqa: E731
                         "correct_per_problem": c, "mean_at_k_stderr": 0.0}
        return {"iteration": iteration, "results": {"dense": row(dense), "rkv:32": row(sparse)}}

    data = {"sparse_rl": {"eval": [evaluation(0, [1, 0, 2], [0, 0, 1]), evaluation(12, [4, 2, 3], [3, 2, 1])]},
            "dense": {"eval": [evaluation(0, [1, 0, 2], [0, 0, 1]), evaluation(12, [4, 4, 2], [2, 3, 0])]}}
    rows = {(r["variant"], r["setting"]): r for r in held_out(data)}
    assert set(rows) == {("sparse_rl", "dense"), ("sparse_rl", "rkv:32"), ("dense", "dense"), ("dense", "rkv:32")}
    sparse = rows[("sparse_rl", "rkv:32")]
    assert sparse["before"] == 1 / 12 and sparse["after"] == 6 / 12
    assert sparse["ratio_to_dense"] == pytest.approx(6 / 5)  # against the dense variant under rkv:32
    # drop: dense decoding minus rkv:32 per problem (1, 0, 2) / 4
    diffs = [0.25, 0.0, 0.5]
    mean = sum(diffs) / 3
    assert sparse["drop_from_dense"] == pytest.approx(mean)
    assert sparse["drop_stderr"] == pytest.approx((sum((d - mean) ** 2 for d in diffs) / 2 / 3) ** 0.5)
    assert rows[("dense", "rkv:32")]["drop_from_dense"] == pytest.approx((2 + 1 + 2) / 12)
    assert "ratio_to_dense" not in rows[("dense", "rkv:32")] and "drop_from_dense" not in rows[("dense", "dense")]


def test_ablation_compares_naive_and_sparse_rl(tmp_path, tiny_model_dir):
    assert variant_overrides("dense") == ["rollout.kv_compression.policy=none"]
    # held-out: 4 problems, greedy, after the last iteration only; the tool adds the rollout's compression
    config = write_test_config(tmp_path / "ablation.yaml", tiny_model_dir, tmp_path / "unused",
                               f"eval: {{path: {TRAIN_DATA}, limit: 4, n_samples: 1, temperature: 0.0, kv: dense}}")
    out = tmp_path / "ablation"
    proc = run_tool(ROOT / "tools" / "ablation.py", config, "--variants", "naive,sparse_rl",
                    "--iterations", "1", "--out", out, *ONE_PROCESS, "--set", "eval.before_training=false",
                    "--set", FIXED_BUDGET, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert (out / "ablation.png").stat().st_size > 5000
    result = json.loads((out / "ablation.json").read_text())
    rows = {row["variant"]: row for row in result["rows"]}
    assert sorted(rows) == ["naive", "sparse_rl"]
    table = (out / "ablation.md").read_text().split("\n\n")
    assert len(table[0].splitlines()) == 2 + 2 and len(table[-1].splitlines()) == 2 + 2 * 2
    # each variant under dense decoding and the rollout's R-KV, evaluated once (eval.before_training false)
    for variant in rows:
        assert [h["iteration"] for h in result["variants"][variant]["eval"]] == [1]
    accuracy = {(r["variant"], r["setting"]): r for r in result["held_out"]}
    assert set(accuracy) == {(v, s) for v in rows for s in ("dense", "rkv:12")}
    assert all("drop_from_dense" in accuracy[(v, "rkv:12")] for v in rows)

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")

    def history(variant, key):
        return {m.step: m.value for m in client.get_metric_history(result["variants"][variant]["run_id"], key)}

    for variant in rows:
        assert sorted(history(variant, "reward/mean")) == [0]
        assert rows[variant]["reward_first"] == history(variant, "reward/mean")[0]
        assert rows[variant]["peak_kv_tokens"] == history(variant, "kv/peak_tokens_per_sample")[0] > 0
        # rollout speed: the 4 x 4 samples' response tokens over the engine's generate time
        assert rows[variant]["rollout_tokens_per_s"] == history(variant, "time/rollout_tokens_per_s")[0] == pytest.approx(
            16 * history(variant, "rollout/response_len_mean")[0] / history(variant, "time/generate_s")[0], rel=1e-9)
        assert rows[variant]["veto_mean"] == history(variant, "correction/veto_fraction")[0]
    (summary,) = client.search_runs([client.get_experiment_by_name("ablation").experiment_id],
                                    filter_string="tags.mlflow.runName = 'summary'")
    assert summary.data.metrics["naive/eval_rkv_12/after"] == accuracy[("naive", "rkv:12")]["after"]
    # same seeds, same initial weights, same eviction: the first rollout of both sparse variants agrees
    for key in ("reward/mean", "kv/evicted_tokens", "rollout/response_len_mean", "mismatch/k3"):
        assert history("naive", key)[0] == history("sparse_rl", key)[0], key
    assert history("naive", "kv/evicted_tokens")[0] > 0 and history("naive", "mismatch/k3")[0] > 1e-4
    # the correction differs: naive rejects nothing, sparse_rl rejects tokens of the same rollout
    assert history("naive", "correction/token_rejected_fraction")[0] == 0 and rows["naive"]["token_rejected_mean"] == 0
    assert history("sparse_rl", "correction/token_rejected_fraction")[0] > 0

    # the same command again: both variants finished, nothing is launched, the summary is rewritten
    again = run_tool(ROOT / "tools" / "ablation.py", config, "--variants", "naive,sparse_rl",
                     "--iterations", "1", "--out", out, *ONE_PROCESS, "--set", FIXED_BUDGET, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("finished in") == 2 and "tools/launch.py" not in again.stdout
    assert json.loads((out / "ablation.json").read_text())["rows"] == result["rows"]
    # --report: a summary of what finished, launching nothing (dense never ran here)
    report = run_tool(ROOT / "tools" / "ablation.py", config, "--variants", "naive,sparse_rl,dense", "--report",
                      "--iterations", "1", "--out", out, *ONE_PROCESS, "--set", FIXED_BUDGET, timeout=120)
    assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
    assert "left out: dense" in report.stdout and "tools/launch.py" not in report.stdout
    assert json.loads((out / "ablation.json").read_text())["rows"] == result["rows"]
