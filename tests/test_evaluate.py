"""tools/evaluate.py: dense and sparse accuracy on one engine, against transformers' greedy decoding
of the same prompts; pass@k against brute-force enumeration."""
import itertools
import json
import statistics
from pathlib import Path

import mlflow
import pytest

from sparse_rl_mega.tracking import default_tracking_uri
from tests.conftest import ROOT, TRAIN_DATA, greedy_correct, run_tool
from sparse_rl_mega.evaluation import pass_at_k
from tools.evaluate import parse_kv


def test_pass_at_k_matches_enumeration():
    for n, c, k in [(5, 2, 1), (5, 2, 3), (6, 0, 2), (4, 4, 2), (7, 3, 7)]:
        outcomes = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        expected = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.unit
def test_kv_spec_errors_are_clear():
    (dense, (label, rkv)) = parse_kv("none,rkv:64")
    assert dense == ("dense", {"policy": "none"}) and label == "rkv:64"
    assert (rkv["policy"], rkv["budget"], rkv["sink"], rkv["interval"]) == ("rkv", 64, 4, 16)  # evaluate's defaults
    with pytest.raises(SystemExit, match="POLICY:BUDGET"):
        parse_kv("rkv")
    with pytest.raises(SystemExit, match="--kv rkv:10: .*budget"):  # checked as the engine checks it
        parse_kv("rkv:10")


def test_dense_accuracy_equals_transformers_greedy(tiny_model_dir, hf_model, tmp_path):
    rows = [json.loads(line) for line in Path(TRAIN_DATA).read_text().splitlines()[:12]]
    bench = tmp_path / "sums.jsonl"
    bench.write_text("".join(json.dumps({"prompt": r["prompt"], "label": r["label"]}) + "\n" for r in rows))
    out = tmp_path / "eval"
    proc = run_tool(ROOT / "tools" / "evaluate.py", tiny_model_dir, "--benchmarks", bench, "--kv", "none,streaming:8",
                    "--sink", "2", "--window", "2", "--interval", "2", "--max-new-tokens", "16", "--reward", "exact_answer",
                    "--out", out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "(forked from this process)" in proc.stdout  # SGLang imported once (rollout/forkserver.py)
    results = json.loads((out / "results.json").read_text())["results"]["sums"]
    assert set(results) == {"dense", "streaming:8"} and (out / "accuracy.png").stat().st_size > 1000

    from transformers import AutoTokenizer

    correct = greedy_correct(hf_model, AutoTokenizer.from_pretrained(str(tiny_model_dir)), rows, 16)
    assert results["dense"]["mean_at_k"] == pytest.approx(sum(correct) / len(correct))
    assert 0 < results["dense"]["mean_at_k"]  # the warmed-up tiny model solves some sums
    # per problem, in order, and the standard error over problems (statistics' sample deviation)
    assert results["dense"]["correct_per_problem"] == [int(c) for c in correct]
    assert results["dense"]["mean_at_k_stderr"] == pytest.approx(statistics.stdev(correct) / len(correct) ** 0.5)

    client = mlflow.MlflowClient(tracking_uri=default_tracking_uri(out))
    (run,) = client.search_runs([client.get_experiment_by_name("evaluate").experiment_id])
    assert run.data.metrics["sums/dense/mean_at_k"] == results["dense"]["mean_at_k"]


@pytest.mark.unit
def test_kv_variants_name_the_rollout_setting():
    from sparse_rl_mega.config import KVCompressionConfig
    from sparse_rl_mega.evaluation import parse_kv_variants

    rkv = KVCompressionConfig(policy="rkv", budget=56)
    assert parse_kv_variants("dense,rollout,snapkv:64", rkv) == [
        ("dense", {"policy": "none"}), ("rkv:56", None),
        ("snapkv:64", {"policy": "snapkv", "budget": 64, "sink": 4, "window": 8, "interval": 128,
                       "selection": "per_layer", "shared_scores": "first_layer",
                       "params": {"kernel": 7, "pool": "max", "gqa_pool": "max"}})]
    assert parse_kv_variants("rollout", KVCompressionConfig()) == [("dense", None)]
    # 'rollout' naming a setting that is also listed is evaluated once (dense rollouts: an ablation's dense arm)
    assert parse_kv_variants("dense,rollout", KVCompressionConfig()) == [("dense", {"policy": "none"})]
    assert parse_kv_variants("rollout,rkv:56", rkv) == [("rkv:56", None)]
    with pytest.raises(ValueError, match="repeat"):
        parse_kv_variants("rkv:56,rkv:56", rkv)
    with pytest.raises(ValueError, match="training rollout's KV setting"):
        parse_kv_variants("rollout")


@pytest.mark.unit
def test_a_dense_run_evaluates_compression_with_its_own_kv_fields():
    """A run with dense rollouts (an ablation's dense arm) evaluated under ``rkv:B``: the engine runs
    R-KV with every other field of the run's kv_compression section (kernel, lambda, selection, sink,
    ...), not the class defaults."""
    from sglang_patches.settings import EngineKVSettings
    from sparse_rl_mega.config import KVCompressionConfig
    from sparse_rl_mega.evaluation import parse_kv_variants

    run_kv = KVCompressionConfig(policy="none", budget=32, sink=0, window=6, interval=4, selection="shared",
                                 kernel=3, lam=0.3, pool="avg", similarity_threshold=0.7)
    (_, override), = parse_kv_variants("rkv:24", run_kv)
    engine = EngineKVSettings.from_config(run_kv, allow_request_override=True)  # the dense run's engine
    served = engine.updated(override)
    assert (served.policy, served.budget, served.sink, served.window, served.interval, served.selection) == \
        ("rkv", 24, 0, 6, 4, "shared")
    assert served.params == {"kernel": 3, "pool": "avg", "gqa_pool": "max", "lam": 0.3, "similarity_threshold": 0.7}
