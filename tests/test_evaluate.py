"""tools/evaluate.py: dense and sparse accuracy on one engine, against transformers' greedy decoding
of the same prompts; pass@k against brute-force enumeration."""
import dataclasses
import itertools
import json
import statistics
from pathlib import Path

import mlflow
import pytest

from sparse_rl_mega.train.tracking import default_tracking_uri
from tests.conftest import ROOT, TRAIN_DATA, greedy_correct, run_tool
from sparse_rl_mega.train.evaluation import pass_at_k
from sparse_rl_mega.cli.preflight import response_room
from sparse_rl_mega.cli import evaluate
from sparse_rl_mega.cli.kv_settings import UsageError, parse_kv


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
    with pytest.raises(UsageError, match="POLICY:BUDGET"):
        parse_kv("rkv")
    # checked as the engine checks it (here without the sink and window derived from the budget)
    with pytest.raises(UsageError, match=r"--kv rkv:10: budget 10 .*\(sink 4, window 8\): use a larger budget"):
        parse_kv("rkv:10")


def _kv(argv: list) -> list:
    """The KV settings main() evaluates for these command-line flags."""
    args = evaluate.parse_args(["MODEL", "--benchmarks", "unused", *argv])
    return parse_kv(args.kv, evaluate.kv_base(args), evaluate.derived_fields(args))


@pytest.mark.unit
def test_small_budgets_run_on_the_default_kv_fields():
    """Without --config the sink and window follow the budget (the user's ``--kv none,rkv:12`` failed
    after the dense pass: budget 12 must exceed sink + window = 12); a flag or --config wins."""
    (_, (_, rkv)) = _kv(["--kv", "none,rkv:12"])
    assert (rkv["sink"], rkv["window"], rkv["interval"]) == (1, 3, 16)
    for budget in range(2, 70):  # every budget the policies can run, every policy, checked as the engine does
        for _, override in _kv(["--kv", f"streaming:{budget},snapkv:{budget},rkv:{budget},h2o:{budget}"]):
            assert override["sink"] + override["window"] < budget and override["window"] >= 1, override
    assert [(o["sink"], o["window"]) for _, o in _kv(["--kv", "rkv:31,rkv:32,rkv:512"])] == [(3, 7), (4, 8), (4, 8)]
    (_, rkv), = _kv(["--kv", "rkv:12", "--window", "2"])
    assert (rkv["sink"], rkv["window"]) == (1, 2)
    with pytest.raises(UsageError, match=r"--kv rkv:12: .*\(sink 4, window 8\)"):
        _kv(["--kv", "rkv:12", "--sink", "4", "--window", "8"])
    config = ROOT / "examples" / "cpu_tiny.yaml"
    from sparse_rl_mega.config import load_config

    run_kv = load_config(config).rollout.kv_compression
    (_, rkv), = _kv(["--kv", "rkv:64", "--config", str(config)])
    assert (rkv["sink"], rkv["window"], rkv["interval"]) == (run_kv.sink, run_kv.window, run_kv.interval)
    with pytest.raises(UsageError, match="smaller --sink / --window"):
        _kv(["--kv", f"rkv:{run_kv.sink + run_kv.window}", "--config", str(config)])


class EngineStarted(Exception):
    """Raised in place of starting SGLang: the command line passed every check."""


@pytest.fixture
def no_engine(monkeypatch):
    """main() may not start SGLang: its preload and the engine raise EngineStarted."""
    import sparse_rl_mega.rollout.engine as engine_module
    import sparse_rl_mega.rollout.engine_processes as engine_processes

    def refuse(*_, **__):
        raise EngineStarted

    monkeypatch.setattr(engine_processes, "preload_cpu_engines", refuse)
    monkeypatch.setattr(engine_module, "RolloutEngine", refuse)


def _fake_model(folder: Path, positions: int) -> Path:
    """A model folder as far as evaluate.py reads it before an engine: config.json with ``positions``
    and a tokenizer.json of one token per word (no special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture
def fake_inputs(tmp_path):
    """A model folder (512 positions) and a 3-row benchmark of 5-token prompts."""
    model = _fake_model(tmp_path / "model", 512)
    bench = tmp_path / "sums.jsonl"
    rows = [{"prompt": f"What is {i} + 1?", "label": str(i + 1)} for i in range(3)]
    bench.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model, bench


@pytest.mark.unit
def test_the_users_small_budget_reaches_the_engine(no_engine, fake_inputs, tmp_path):
    model, bench = fake_inputs
    with pytest.raises(EngineStarted):
        evaluate.main([str(model), "--benchmarks", str(bench), "--kv", "none,rkv:12", "--out", str(tmp_path / "out")])


@pytest.mark.unit
def test_the_cap_is_set_before_sglang_is_imported(no_engine, fake_inputs, tmp_path, capsys):
    """The user's default --max-new-tokens 512 on a model of 512 positions: a one-line notice, then the
    engine; a prompt that does not fit: one line naming it, exit status 2, no engine."""
    _, bench = fake_inputs
    small = _fake_model(tmp_path / "small", 64)
    with pytest.raises(EngineStarted):
        evaluate.main([str(small), "--benchmarks", str(bench), "--out", str(tmp_path / "out")])
    assert capsys.readouterr().out == ("[evaluate] --max-new-tokens 512 capped to 57: the model has 64 positions and "
                                       "the longest prompt has 5 tokens (SGLang generates at most positions - "
                                       "prompt - 2)\n")
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "word " * 57 + "end", "label": "1"}) + "\n")
    code = evaluate.main([str(small), "--benchmarks", f"{bench},{tmp_path / 'long.jsonl'}",
                          "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == (
        f"evaluate.py: error: --benchmarks: the longest prompt ({tmp_path / 'long.jsonl'}:1) has 58 tokens and the "
        "model has 64 positions: SGLang takes prompts of at most 57 (leave the longer prompts out)\n")


OK = ["{model}", "--benchmarks", "{bench}"]  # a command line that passes (placeholders: fake_inputs, tmp_path)


@pytest.mark.unit
@pytest.mark.parametrize("argv, message", [
    ([*OK, "--kv", "none,rkv:12", "--sink", "4", "--window", "8"],
     "--kv rkv:12: budget 12 must exceed sink + window = 12 (sink 4, window 8): use a larger budget"),
    ([*OK, "--kv", "none,rkv:1"], "--kv rkv:1: budget 1 must exceed sink + window = 1"),
    ([*OK, "--kv", "rkv:64", "--lam", "2"], "--kv rkv:64: R-KV: need 0 <= lam <= 1, got 2.0: fix that KV flag"),
    ([*OK, "--kv", "snapkv:64", "--kernel", "4"], "--kv snapkv:64: SnapKVPolicy: kernel must be odd"),
    ([*OK, "--kv", "rkv"], "--kv: 'rkv': expected dense, rollout or POLICY:BUDGET"),
    ([*OK, "--kv", "none,rollout"], "--kv rollout: names the KV setting of --config's run; give --config"),
    ([*OK, "--interval", "0", "--kv", "rkv:64"], "--interval: must be >= 1, got 0"),
    ([*OK, "--samples", "4"], "--samples: 4 needs --temperature > 0"),
    ([*OK, "--samples", "0", "--temperature", "1"], "--samples: must be >= 1, got 0"),
    ([*OK, "--temperature", "-1"], "--temperature: must be >= 0"),
    ([*OK, "--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
    ([*OK, "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    ([*OK, "--limit", "0"], "--limit: must be >= 1, got 0"),
    (["{tmp}/missing", "--benchmarks", "{bench}"], "MODEL {tmp}/missing: no such folder"),
    (["{tmp}", "--benchmarks", "{bench}"], "MODEL {tmp}: neither an HF model folder (no config.json) nor a training"),
    (["{model}", "--benchmarks", "gsm8k"], "--benchmarks gsm8k: {tmp}/gsm8k.jsonl not found (make it with: python "
                                           "tools/prepare_data.py --benchmarks gsm8k --out {tmp})"),
    (["{model}", "--benchmarks", "{bench},gsm8k_easy"],
     "--benchmarks gsm8k_easy: {tmp}/gsm8k_easy.jsonl not found (make it with: python tools/prepare_data.py "
     "--benchmarks gsm8k --easy --out {tmp})"),
    (["{model}", "--benchmarks", "mine"], "--benchmarks mine: {tmp}/mine.jsonl not found (tools/prepare_data.py "
                                          "makes gsm8k, "),
    (["{model}", "--benchmarks", "{tmp}/bad.jsonl"],
     "--benchmarks {tmp}/bad.jsonl: {tmp}/bad.jsonl: 1 bad row(s): {tmp}/bad.jsonl:1: key 'label' is missing (the "
     "row has 'prompt')\n"),
])
def test_a_bad_command_line_fails_in_one_line_before_any_engine(no_engine, fake_inputs, tmp_path, capsys, argv,
                                                                message):
    """Each problem: one ``evaluate.py: error:`` line naming the flag or setting (and what to do), exit
    status 2, before SGLang is imported or an engine starts (the user saw a traceback after the dense
    pass, or from SGLang after a 13 s engine start)."""
    model, bench = fake_inputs
    (tmp_path / "bad.jsonl").write_text('{"prompt": "no label"}\n')
    names = {"model": model, "bench": bench, "tmp": tmp_path}
    code = evaluate.main([arg.format(**names) for arg in argv] + ["--data-dir", str(tmp_path),
                                                                  "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out)
    assert len(err.splitlines()) == 1 and err.startswith("evaluate.py: error: "), err
    assert message.format(**names) in err, err


@pytest.mark.unit
def test_a_checkpoint_is_recognised_by_the_learners_marker(tmp_path):
    """MODEL may be a training checkpoint (exported first): an iter_* folder holding the marker the
    learner writes last, or a folder of them."""
    from sparse_rl_mega.runtime.checkpoint_files import MARKER

    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / MARKER).write_text("{}")
    assert evaluate.model_kind(str(tmp_path)) == evaluate.model_kind(str(tmp_path / "iter_0000002")) == "checkpoint"
    (tmp_path / "iter_0000003").mkdir()  # a save still being written: no marker yet
    with pytest.raises(UsageError, match="neither an HF model folder"):
        evaluate.model_kind(str(tmp_path / "iter_0000003"))


@pytest.mark.unit
def test_the_missing_data_hint_names_the_benchmark():
    from sparse_rl_mega.data.prepare import DEFAULT_OUT

    assert evaluate.missing_benchmark_hint("gsm8k", DEFAULT_OUT) == \
        "make it with: python tools/prepare_data.py --benchmarks gsm8k"
    assert evaluate.missing_benchmark_hint("math500_easy", DEFAULT_OUT) == \
        "make it with: python tools/prepare_data.py --benchmarks math500 --easy"


@pytest.mark.unit
def test_max_new_tokens_is_capped_to_what_sglang_generates(tmp_path):
    """The cap matches SGLang 0.5.23's own limits, measured on the tiny model (context 512): after a
    500-token prompt it generates at most 10 tokens (max_new_tokens 12 gives 10), after 505 at most 5,
    and it refuses a 506-token prompt; with a 300-slot KV pool, 8 after 290 and it refuses 294."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"max_position_embeddings": 512}))
    assert evaluate.context_length(tmp_path) == 512
    config.write_text(json.dumps({"max_position_embeddings": 512, "seq_length": 300}))  # SGLang's key order
    assert evaluate.context_length(tmp_path) == 300
    linear = {"rope_type": "linear", "factor": 2}
    config.write_text(json.dumps({"max_position_embeddings": 512, "rope_scaling": linear}))
    assert evaluate.context_length(tmp_path) == 1024
    config.write_text(json.dumps({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}))
    assert evaluate.context_length(tmp_path) == 2048

    assert [response_room(512, n) for n in (500, 505, 506, 512)] == [10, 5, 0, 0]
    assert [response_room(300, n) for n in (290, 293, 294)] == [8, 5, 0]
    lines = []
    assert evaluate.fit_max_new_tokens(512, 512, 16384, (9, "a.jsonl:3"), lines.append) == 501
    assert lines == ["[evaluate] --max-new-tokens 512 capped to 501: the model has 512 positions and the longest "
                     "prompt has 9 tokens (SGLang generates at most positions - prompt - 2)"]
    assert evaluate.fit_max_new_tokens(64, 512, 16384, (9, "a.jsonl:3"), lines.append) == 64 and len(lines) == 1
    assert evaluate.fit_max_new_tokens(512, 512, 300, (9, "a.jsonl:3"), lines.append) == 289
    assert "capped to 289: the KV pool (--max-total-tokens) has 300 slots" in lines[-1]
    with pytest.raises(UsageError, match=r"--benchmarks: the longest prompt \(b.jsonl:7\) has 506 tokens and the "
                                         r"model has 512 positions: SGLang takes prompts of at most 505"):
        evaluate.fit_max_new_tokens(16, 512, 16384, (506, "b.jsonl:7"))


def test_dense_accuracy_equals_transformers_greedy(tiny_model_dir, hf_model, tmp_path):
    rows = [json.loads(line) for line in Path(TRAIN_DATA).read_text().splitlines()[:12]]
    bench = tmp_path / "sums.jsonl"
    bench.write_text("".join(json.dumps({"prompt": r["prompt"], "label": r["label"]}) + "\n" for r in rows))
    out = tmp_path / "eval"
    proc = run_tool(ROOT / "tools" / "evaluate.py", tiny_model_dir, "--benchmarks", bench, "--kv", "none,streaming:8",
                    "--sink", "2", "--window", "2", "--interval", "2", "--max-new-tokens", "16", "--reward", "exact_answer",
                    "--out", out, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # SGLang imported once: the engine's processes are children of a warm server (rollout/forkserver.py; run in
    # this worker, the worker's: a user's evaluate.py forks its own, "forked from this process")
    assert "(forked from a preloaded server)" in proc.stdout
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
@pytest.mark.unit
def test_the_engine_own_kv_setting_is_checked_before_it_starts():
    """--config's budget 32 with --sink 24 (24 + 8 = 32): each requested setting (rkv:56) is valid, but the
    engine's own is not, and its plugin would refuse it at start (it once ran dense under the rkv:56 label)."""
    from sparse_rl_mega.config import KVCompressionConfig

    base = KVCompressionConfig(policy="rkv", budget=32, sink=24, window=8)
    with pytest.raises(evaluate.UsageError, match=r"^the engine's KV setting \(rkv:32, the --config budget with the KV "
                                                  r"flags\): budget 32 must exceed sink \+ window = 32 \(sink 24, "
                                                  r"window 8\): use a larger budget"):
        evaluate.parse_kv("rkv:56", base)
    assert evaluate.parse_kv("rkv:56", dataclasses.replace(base, sink=22))[0][1]["budget"] == 56


def test_kv_variants_name_the_rollout_setting():
    from sparse_rl_mega.config import KVCompressionConfig
    from sparse_rl_mega.config.evaluation import parse_kv_variants

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
    from sparse_rl_mega.kv.engine_settings import EngineKVSettings
    from sparse_rl_mega.config import KVCompressionConfig
    from sparse_rl_mega.config.evaluation import parse_kv_variants

    run_kv = KVCompressionConfig(policy="none", budget=32, sink=0, window=6, interval=4, selection="shared",
                                 params=dict(kernel=3, lam=0.3, pool="avg", similarity_threshold=0.7))
    (_, override), = parse_kv_variants("rkv:24", run_kv)
    engine = EngineKVSettings.from_config(run_kv, allow_request_override=True)  # the dense run's engine
    served = engine.updated(override)
    assert (served.policy, served.budget, served.sink, served.window, served.interval, served.selection) == \
        ("rkv", 24, 0, 6, 4, "shared")
    assert served.params == {"kernel": 3, "pool": "avg", "gqa_pool": "max", "lam": 0.3, "similarity_threshold": 0.7}
