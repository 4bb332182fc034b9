"""The whole loop under torchrun (2 processes, Megatron PP=2, one SGLang engine with eviction):
rollout -> reward -> logp_old -> corrected loss -> optimizer -> weight sync -> MLflow."""
import mlflow

from sparse_rl_mega.train.tracking import default_tracking_uri

REQUIRED = ["reward/mean", "correction/veto_fraction", "correction/token_rejected_fraction",
            "correction/is_weight_mean", "correction/is_weight_max", "mismatch/k3", "kv/evicted_tokens",
            "kv/peak_slots_in_use", "time/rollout_s", "time/train_s", "time/sync_s", "train/loss",
            "sync/max_abs_logprob_diff", "sync/pre_sync_max_abs_logprob_diff", "mismatch/k1",
            "correction/is_ess_fraction", "train/entropy", "train/clip_fraction", "train/approx_kl_old",
            "advantage/mean", "advantage/std", "advantage/zero_fraction", "train/kl_ref", "kv/compressions_per_sample", "kv/evicted_tokens_per_sample_max"]


def _run(e2e_run):
    run_dir, proc = e2e_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    client = mlflow.MlflowClient(tracking_uri=default_tracking_uri(run_dir))
    experiment = client.get_experiment_by_name("e2e-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    return client, runs[0], proc


def test_iterations_complete_and_metrics_land_in_mlflow(e2e_run):
    client, run, proc = _run(e2e_run)
    assert run.info.status == "FINISHED"
    for key in REQUIRED:
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [0, 1, 2], key
    assert "[iter 3/3]" in proc.stdout
    assert run.data.params["parallel.pipeline_model_parallel_size"] == "2"


def test_start_up_is_itemised_and_known_warnings_are_quiet(e2e_run):
    """One line says where start-up went, that the learner ranks were forked from the launcher (which
    imported their modules once: sparse_rl_mega/train/forked_ranks.py) and the CPU engine's processes from the
    rank that hosts it (rollout/forkserver.py); the dependencies' CPU-only
    notices (sparse_rl_mega/runtime/quiet.py) are filtered in the launcher, the torchrun workers and SGLang's
    processes alike."""
    import re

    from sparse_rl_mega.runtime.quiet import KNOWN_HARMLESS

    _, proc = e2e_run
    ready = re.search(r"\[setup\] ready ([\d.]+) s \(launch and imports [\d.]+, learner [\d.]+, .*MLflow [\d.]+.*\) "
                      r"after launch \(ranks forked from the launcher\); engine up in [\d.]+ s \(forked from this process\)",
                      proc.stdout)
    assert ready, proc.stdout[:3000]
    assert 0 < float(ready.group(1)) < 300
    assert "[done] shut down in" in proc.stdout
    output = proc.stdout + proc.stderr
    for prefix, _, _ in KNOWN_HARMLESS:
        assert prefix not in output, prefix
    assert "Warning" not in output, [line for line in output.splitlines() if "Warning" in line][:5]
    assert "Task was destroyed" not in output  # the engine's event loop is closed at shut-down


def test_console_says_where_things_went(e2e_run):
    """An ETA on every iteration line but the last, one line per saved checkpoint, the total at the end,
    the MLflow run named after what ran and how to open it; no weight-loading bar for a one-file model;
    the run folder's lock gone with the job."""
    import re

    from tests.conftest import ROOT

    run_dir, proc = e2e_run
    took = r"(?:\d+ s|\d+m \d\ds|\d+h \d\dm)"  # trainer.duration
    iterations = re.findall(rf"^\[iter (\d)/3\] .*\| [\d.]+ s( \| ETA {took})?$", proc.stdout, re.MULTILINE)
    assert [(i, bool(eta)) for i, eta in iterations] == [("1", True), ("2", True), ("3", False)], proc.stdout[-3000:]
    for iteration in (1, 2, 3):
        assert re.search(rf"^\[checkpoint\] iteration {iteration} saved in [\d.]+ s \([\d.]+ MiB, digests [\d.]+ s\): "
                         rf".*{run_dir}/checkpoints/"
                         rf"iter_000000{iteration}$", proc.stdout, re.MULTILINE), proc.stdout[-3000:]
    assert re.search(rf"^\[done\] 3 iteration\(s\) in {took} \({took} since launch\); run folder {run_dir}$",
                     proc.stdout, re.MULTILINE), proc.stdout[-3000:]
    assert (f"[done] MLflow run 'e2e-rkv12-sparse_rl': make -C {ROOT} mlflow-ui RUN={run_dir}, then open "
            "http://127.0.0.1:5000") in proc.stdout
    client, run, _ = _run(e2e_run)
    assert run.info.run_name == "e2e-rkv12-sparse_rl"
    assert "loading shards" not in proc.stdout + proc.stderr
    assert not (run_dir / ".lock").exists()  # the job's lock goes with the job


def test_eviction_was_active_during_rollouts(e2e_run):
    client, run, _ = _run(e2e_run)
    evicted = [m.value for m in client.get_metric_history(run.info.run_id, "kv/evicted_tokens")]
    assert all(v > 0 for v in evicted)


def test_automatic_budget_follows_the_mismatch_and_the_engine_keeps_it(e2e_run):
    """The test config's automatic budget (conftest.AUTO_BUDGET: from 12 in [8, 20], +6 when the 1 %
    quantile of log rho is below log 0.9, else -2): each iteration's logged budget follows the law from
    the one before and the mismatch it measured; the engine's largest request (its own measure) is what
    replaying every sample's lengths at that budget gives, within budget + interval + 1."""
    import math

    client, run, proc = _run(e2e_run)

    def history(key):
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]

    budgets, p1 = history("kv/budget"), history("mismatch/log_rho_p1")
    assert budgets[0] == 12 and len(budgets) == 3
    for before, measured, after in zip(budgets, p1, budgets[1:]):
        expected = min(20, before + 6) if measured < math.log(0.9) else max(8, before - 2)
        assert after == expected, (budgets, p1)
    engine_peak, replayed = history("kv/peak_request_tokens"), history("kv/peak_tokens_per_sample_max")
    assert engine_peak == replayed, (engine_peak, replayed, budgets)
    assert all(budget < peak <= budget + 2 + 1 for budget, peak in zip(budgets, engine_peak)), (engine_peak, budgets)
    assert f"budget {budgets[-1]:.0f} evicted/sample" in proc.stdout  # the progress line
    assert "automatic budget in [8, 20] tokens from 12" in proc.stdout  # the plan at launch


def test_weight_sync_makes_engine_equal_learner(e2e_run):
    """Before the sync the engine serves the old weights (the optimizer moved the learner); after it,
    the engine's dense logprobs equal the Megatron learner's (PP=2 shards resharded to HF names)."""
    client, run, _ = _run(e2e_run)
    after = [m.value for m in client.get_metric_history(run.info.run_id, "sync/max_abs_logprob_diff")]
    before = [m.value for m in client.get_metric_history(run.info.run_id, "sync/pre_sync_max_abs_logprob_diff")]
    assert all(v < 1e-4 for v in after), after
    assert all(v > 1e-3 for v in before), before


def test_checkpoint_saved_and_only_last_kept(e2e_run):
    run_dir, proc = e2e_run
    assert proc.returncode == 0
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["iter_0000002", "iter_0000003"]  # save_interval 1, keep_last 2: iteration 1's was removed
    for name in kept:
        assert (run_dir / "checkpoints" / name / "metadata.json").is_file()
        assert (run_dir / "checkpoints" / name / "sparse_rl_mega.json").is_file()


def test_a_resume_with_another_model_is_refused_before_anything_starts(e2e_run, tiny_model_dir, tmp_path):
    """``--resume`` into this run's folder with a config of another model shape: the checkpoint it would
    load is compared with the config before any process starts (one line naming the checkpoint and the
    differences), not in every rank after the engine and the learner started; the same shape passes."""
    from sparse_rl_mega.cli.preflight import resume_problem
    from sparse_rl_mega.config import load_config
    from tests.conftest import write_test_config

    import json

    run_dir, _ = e2e_run
    same = write_test_config(tmp_path / "same.yaml", tiny_model_dir, run_dir)
    assert resume_problem(load_config(same, ["checkpoint.resume=auto"])) is None
    bigger = tmp_path / "bigger-model"  # (its config.json is all the check reads)
    bigger.mkdir()
    (bigger / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 512}))
    config = write_test_config(tmp_path / "other.yaml", bigger, run_dir)
    other = load_config(config, ["checkpoint.resume=auto", "model.arch.hidden_size=128", "model.arch.num_layers=2"])
    assert resume_problem(other) == (
        f"checkpoint.resume: {run_dir / 'checkpoints' / 'iter_0000003'} holds another model than this config's "
        "(model.arch.num_layers: 4 -> 2; model.arch.hidden_size: 64 -> 128; model.arch.head_dim: 16 -> 32): resume it "
        "with the config that saved "
        "it, or give this one a new trainer.run_dir")


def test_held_out_evaluation_matches_transformers_greedy(e2e_run, tiny_model_dir, hf_model, tmp_path):
    """The trainer's held-out evaluation (greedy, on the rollout engine, between iterations) scores what
    transformers' greedy decoding of the same prompts scores: with the initial weights before training
    and with the exported final checkpoint after it. Dense and R-KV settings are both reported."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import E2E_EVAL_MAX_NEW, E2E_EVAL_ROWS, ROOT, TRAIN_DATA, greedy_correct, run_tool

    client, run, proc = _run(e2e_run)
    run_dir, _ = e2e_run
    history = json.loads((run_dir / "eval.json").read_text())["history"]
    assert [h["iteration"] for h in history] == [0, 2, 3]  # before, eval.interval 2, after the last
    for h in history:
        assert set(h["results"]) == {"dense", "rkv:auto"}  # the rollout's compression at the budget in force
        assert h["results"]["dense"]["problems"] == E2E_EVAL_ROWS
        assert h["results"]["dense"]["evicted_tokens_per_sample"] == 0
    dense = client.get_metric_history(run.info.run_id, "eval/dense/mean_at_k")
    assert sorted(m.step for m in dense) == [0, 2, 3]
    assert "[eval] held-out accuracy" in proc.stdout  # the before/after table

    rows = [json.loads(line) for line in TRAIN_DATA.read_text().splitlines()[:E2E_EVAL_ROWS]]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    before = greedy_correct(hf_model, tokenizer, rows, E2E_EVAL_MAX_NEW)
    assert history[0]["results"]["dense"]["mean_at_k"] == sum(before) / len(rows)

    exported = tmp_path / "final"
    done = run_tool(ROOT / "tools" / "export_hf.py", run_dir / "checkpoints" / "iter_0000003", "--out", exported,
                    timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    trained = AutoModelForCausalLM.from_pretrained(exported).eval()
    after = greedy_correct(trained, tokenizer, rows, E2E_EVAL_MAX_NEW)
    assert history[-1]["results"]["dense"]["mean_at_k"] == sum(after) / len(rows)
