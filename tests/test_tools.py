"""Every script in tools/ runs in the suite, so none can rot unseen. Here: each one's ``--help`` (run as a
user runs it, in a fresh process), the data generator against the committed data it made, the GPU
check's CPU verdict and its dry run (the wheel set for the lent GPU machine), and one real call of the weight-sync, rollout and sampling-support benchmarks on the
tiny model.
Elsewhere: launch.py (tests/conftest.py: run_launch, e2e_run), prepare_model.py (tests/test_learner.py), prepare_data.py
(tests/test_data_math.py), evaluate.py (tests/test_evaluate.py), export_hf.py (tests/test_export_hf.py,
tests/test_resume.py), ablation.py (tests/test_ablation.py), bench_overlap.py and chaos.py with a chosen
fault (tests/test_overlap.py), send_unsent_metrics.py (tests/test_tracking.py), setup_env.sh (every run: `make
test` builds the venv with it)."""
import json
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, TRAIN_DATA, run_captured, run_tool

# (tools/_bootstrap.py is no script: every Python tool imports it first)
SCRIPTS = sorted(p.name for p in (ROOT / "tools").iterdir()
                 if p.suffix in (".py", ".sh") and p.is_file() and not p.name.startswith("_"))
# where each script is run for real (this module or another)
RUN_BY = {
    "ablation.py": "tests/test_ablation.py", "bench_overlap.py": "tests/test_overlap.py",
    "bench_rollout.py": "tests/test_tools.py", "bench_sampling.py": "tests/test_tools.py",
    "bench_sync.py": "tests/test_tools.py",
    "chaos.py": "tests/test_overlap.py", "evaluate.py": "tests/test_evaluate.py",
    "export_hf.py": "tests/test_export_hf.py", "gpu_check.py": "tests/test_tools.py",
    "gpu_check.sh": "tests/test_tools.py",
    "launch.py": "tests/conftest.py", "make_arith_data.py": "tests/test_tools.py",
    "prepare_data.py": "tests/test_data_math.py", "prepare_model.py": "tests/test_learner.py",
    "send_unsent_metrics.py": "tests/test_tracking.py", "setup_env.sh": "Makefile",
}


@pytest.mark.unit
def test_every_tool_is_run_somewhere():
    assert sorted(RUN_BY) == SCRIPTS, "a new script in tools/: run it in a test and list it in RUN_BY"
    for script, where in RUN_BY.items():
        assert script in (ROOT / where).read_text(), (script, where)


@pytest.mark.unit
def test_every_python_tool_is_thin_over_the_installed_package():
    """No tool edits ``sys.path`` (the package is installed: ``make env``), each imports tools/_bootstrap.py
    before the package, and none is imported by a test. Plant: a ``sys.path.insert`` in a tool, and this
    fails."""
    for script in SCRIPTS:
        if not script.endswith(".py"):
            continue
        text = (ROOT / "tools" / script).read_text()
        assert "sys.path" not in text, f"tools/{script} edits sys.path"
        if "sparse_rl_mega" in text.replace("sparse_rl_mega/", ""):
            assert text.index("import _bootstrap") < text.index("from sparse_rl_mega"), script
    imported = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in sorted((ROOT / "tests").rglob("*.py"))
                for line in path.read_text().splitlines()
                if line.lstrip().startswith(("from tools", "import tools"))]
    assert imported == [], imported


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.endswith(".py")])
def test_help(script):
    done = run_captured([sys.executable, ROOT / "tools" / script, "--help"], 120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.startswith("usage: ") and len(done.stdout.splitlines()) > 3, done.stdout
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr[-2000:]


@pytest.mark.unit
@pytest.mark.parametrize("script", ["launch.py", "export_hf.py", "bench_sync.py"])
def test_a_tool_started_from_another_python_says_which_python_runs_it(script):
    """The venv's base interpreter has none of the project's packages: a tool started with it stops in one
    line naming the environment's Python (not a ModuleNotFoundError traceback)."""
    from pathlib import Path

    base = Path(sys.base_prefix) / "bin" / "python3"
    probe = run_captured([base, "-c", "import torch"], 60)
    if probe.returncode == 0:
        pytest.skip(f"{base} has torch: no Python without the project's packages here")
    done = run_captured([base, ROOT / "tools" / script, "--help"], 60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(f"sparse-rl-mega: this Python ({base}) does not have the project installed") and \
        f"{ROOT / '.venv' / 'bin' / 'python'} tools/launch.py CONFIG" in lines[0], lines[0]


@pytest.mark.unit
def test_make_arith_data_writes_the_committed_example_data(tmp_path):
    done = run_captured([sys.executable, ROOT / "tools" / "make_arith_data.py", tmp_path / "sums.jsonl"], 60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "sums.jsonl").read_bytes() == TRAIN_DATA.read_bytes()


def test_gpu_check_on_a_cpu_machine_runs_the_cpu_part_and_says_the_gpu_parts_did_not_run(tmp_path):
    """On a machine without CUDA: exit 2 (parts NOT RUN, each with its reason), the CPU part PASS, log
    and JSON written. (Its CPU part here is one small module: the four it runs by default are in the
    suite anyway.)"""
    from sparse_rl_mega.cli.gpu_check import PARTS

    done = run_captured(["bash", ROOT / "tools" / "gpu_check.sh", "--out", tmp_path], 600,
                        env={"PYTHON": sys.executable, "GPU_CHECK_CPU_TESTS": "tests/test_cpu_shims.py"})
    out = done.stdout
    assert done.returncode == 2, out[-3000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr[-2000:]
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    assert figures["versions"]["torch"].startswith("2.13.0") and figures["versions"]["cuda"] is None
    parts = figures["parts"]
    assert parts["pure math on this machine"]["status"] == "PASS", parts
    for name, _, not_written in PARTS:
        assert parts[name]["status"] == "NOT RUN" and parts[name]["reason"] == (
            not_written or "no CUDA device visible to torch"), (name, parts[name])
        assert f"[gpu_check] NOT RUN {name}: " in out
    assert "passed" in (tmp_path / "gpu_check.log").read_text()


def test_gpu_check_dry_run_builds_a_wheel_set_that_installs_without_an_index(tmp_path):
    """--dry-run here: megatron-core for CPython 3.12 and the project's wheel, under the 64 MiB a lent
    GPU machine takes with the tree, installed into a Python 3.12 target with no index (when one is on
    this machine: pyenv's, here), and every part reported NOT RUN with its reason. --help is usage."""
    from sparse_rl_mega.cli.gpu_check import CARRY_LIMIT, PARTS

    wheels = tmp_path / "wheels"
    done = run_captured(["bash", ROOT / "tools" / "gpu_check.sh", "--dry-run", "--wheels", wheels, "--out",
                         tmp_path / "out"], 600, env={"PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    files = figures["wheels"]["files"]
    assert sorted(name.split("-")[0] for name in files) == ["megatron_core", "sparse_rl_mega"], files
    assert any("cp312" in name for name in files) and figures["wheels"]["bytes"] < CARRY_LIMIT
    check = figures["install_check"]
    if check != "no Python 3.12 here":
        assert {"megatron", "sparse_rl_mega", "sglang_patches"} <= set(check["installed"]), check
    assert {name for name, part in figures["parts"].items() if part["status"] == "NOT RUN"} == \
        {name for name, _, _ in PARTS} | {"pure math on this machine"}
    usage = run_captured(["bash", ROOT / "tools" / "gpu_check.sh", "--help"], 60, env={"PYTHON": sys.executable})
    assert usage.returncode == 0 and usage.stdout.startswith("usage: ") and not wheels.with_name("--help").exists()


def test_gpu_check_reads_each_tests_outcome_and_figures(tmp_path):
    """How the check judges a part from pytest's JUnit XML: a failure fails it (with the message), tests
    all skipped leave it NOT RUN with their reasons, a pass with an optional skip passes and lists it;
    the figures a test prints reach the JSON."""
    from sparse_rl_mega.cli.gpu_check import Report, judge, printed_figures, pytest_outcomes

    tests = tmp_path / "test_parts.py"
    tests.write_text("""import pytest
def test_fine():
    print("PASS fp32 local vs transformers fp32: max 0.001")
    print('STEP_FIGURES {"tokens_per_s": 5.0}')
def test_broken():
    assert 1 == 2, "planted"
def test_absent():
    pytest.skip("Transformer Engine is not installed")
@pytest.mark.parametrize("k", [1, 2])
def test_param(k):
    pass
""")
    outcomes, summary = pytest_outcomes(str(tests), Report(tmp_path / "out"), timeout=120)
    assert "1 failed, 3 passed, 1 skipped" in summary, summary
    assert judge(["test_fine"], outcomes)[0] == "PASS" and judge(["test_param"], outcomes)[2]["passed"] == 2
    status, reason, _ = judge(["test_fine", "test_broken"], outcomes)
    assert status == "FAIL" and "planted" in reason
    assert judge(["test_absent"], outcomes)[:2] == ("NOT RUN", "Transformer Engine is not installed")
    assert judge(["test_fine", "test_absent"], outcomes)[:2] == ("PASS", "skipped: Transformer Engine is not installed")
    assert judge(["test_missing"], outcomes)[:2] == ("NOT RUN", "no test of it ran")
    assert printed_figures(["test_fine"], outcomes) == {
        "learner_report": ["PASS fp32 local vs transformers fp32: max 0.001"], "step": {"tokens_per_s": 5.0}}
    # a run past its limit is killed with its children (a torchrun rank of a GPU test): one line, no hang
    (tmp_path / "test_slow.py").write_text("import subprocess, sys, time\n"
                                           "def test_slow():\n"
                                           "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                                           "    time.sleep(60)\n")
    started = time.monotonic()
    assert pytest_outcomes(str(tmp_path / "test_slow.py"), Report(tmp_path / "out"), timeout=4) == \
        ({}, "timed out after 4 s")
    assert time.monotonic() - started < 30
    left = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True).stdout.split()
    assert not left, left


def test_gpu_step_check_runs_its_step_on_the_cpu_in_a_tiny_shape(tmp_path):
    """The GPU check's learner step (tests/helpers/gpu_step_check.py) in a tiny shape on the CPU: its
    figures are written and read as tools/gpu_check.py reads them (no memory figure without CUDA)."""
    from tests.conftest import run_torchrun
    from sparse_rl_mega.cli.gpu_check import step_summary

    out = tmp_path / "step.json"
    proc = run_torchrun(ROOT / "tests" / "helpers" / "gpu_step_check.py", out, "--shape", "tiny", "--seq", "64",
                        "--dtype", "float32", "--steps", "2", nproc=1, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    step = json.loads(out.read_text())
    assert step["finite"] and step["tokens_per_step"] == 128 and len(step["step_seconds"]) == 2
    assert step["flops_per_token"] == 6 * step["params"] + 6 * 2 * 64 * 64 and step["peak_allocated_bytes"] is None
    assert step["plan_bytes"]["total"] == step["plan_bytes"]["states"] + step["plan_bytes"]["activations"] > 0
    assert "tokens/s" in step_summary(step) and "peak memory" not in step_summary(step)


def test_gpu_ipc_check_hands_buckets_over_on_the_cpu_bit_for_bit(tmp_path):
    """The GPU check's push hand-over (tests/helpers/gpu_ipc_check.py) on the CPU, where the buffers
    travel as shared memory: several buckets of the tiny shape, every HF tensor bit for bit."""
    from tests.conftest import run_torchrun
    from sparse_rl_mega.cli.gpu_check import ipc_summary

    out = tmp_path / "ipc.json"
    proc = run_torchrun(ROOT / "tests" / "helpers" / "gpu_ipc_check.py", out, "--shape", "tiny", "--dtype", "float32",
                        "--bucket-mb", "0.05", "--repeats", "1", nproc=1, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    ipc = json.loads(out.read_text())
    assert ipc["transport"] == "shared memory" and ipc["buckets"] > 1 and ipc["same_names"] and ipc["bit_exact"], ipc
    assert "bit for bit True" in ipc_summary(ipc)


@pytest.mark.unit
def test_bench_tools_check_their_inputs_before_anything_starts(tmp_path):
    """A KV budget the policies refuse stops bench_rollout.py in one line naming the flags (not a traceback
    from the engine 44 s later); bench_sync.py runs tools/launch.py's pre-flight: a missing data file
    is one line naming the key, before any rank or engine starts."""
    started = time.perf_counter()
    done = run_tool(ROOT / "tools" / "bench_rollout.py", "--budget", "8", "--policies", "rkv", timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "error: --budget 8 with --sink 4 --window 8 (rkv): budget 8 must exceed sink + window = 12"), done.stderr
    missing = tmp_path / "none.jsonl"
    done = run_tool(ROOT / "tools" / "bench_sync.py", ROOT / "examples" / "cpu_tiny.yaml",
                    f"--set=data.train_path={missing}", "--set=tracking.enabled=false", timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == (
        f"config error: {ROOT / 'examples' / 'cpu_tiny.yaml'}: data.train_path: {missing} is not a file (a jsonl of "
        "prompts and labels)"), done.stderr[-3000:]
    assert time.perf_counter() - started < 30 and "Traceback" not in done.stderr


def test_bench_sync_times_both_methods_on_the_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "sync.json"
    done = run_tool(ROOT / "tools" / "bench_sync.py", ROOT / "examples" / "cpu_tiny.yaml",
                    f"--set=model.path={tiny_model_dir}", "--set=tracking.enabled=false",
                    f"--set=trainer.run_dir={tmp_path / 'run'}", "--buckets", "1", "--repeats", "1", "--json", out,
                    timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert sorted(figures["sync"]) == ["broadcast.1MB", "tensor.1MB"] and figures["bytes"] > 0
    assert all(ratio > 0 for ratio in figures["ratios"].values())
    assert "sync_over_copy.tensor.1MB=" in done.stdout


def test_bench_rollout_compares_a_policy_with_dense_on_the_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "rollout.json"
    done = run_tool(ROOT / "tools" / "bench_rollout.py", "--model", tiny_model_dir,
                    "--requests", "4", "--prompt-tokens", "8", "--new-tokens", "24", "--budget", "12",
                    "--interval", "2", "--window", "4", "--sink", "2", "--policies", "streaming",
                    "--selections", "per_layer", "--repeats", "1", "--pools", "unbounded", "--json", out,
                    timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    figures = json.loads(out.read_text())
    text = json.dumps(figures)
    assert "streaming" in text and "dense" in text, text[:2000]
    assert "=" in done.stdout.splitlines()[-1]  # the ratios, last
    # the engine's first requests are not charged to the first variant timed (dense: 8.4 tok/s against
    # streaming's 721 in a user's --repeats 1 run): every variant runs once, untimed, first
    assert "[bench] warm-up: 2 variant(s) x 1 request x 8 new tokens in " in done.stdout, done.stdout[-3000:]
    assert done.stdout.index("[bench] warm-up:") < done.stdout.index("  dense: ")


def test_bench_sampling_measures_what_supports_cost_on_the_tiny_model(tiny_model_dir, tmp_path):
    """top-k 5 with and without supports on one engine: every token of the supported run carries at
    most 5 ids, and the ratios come last; a malformed truncation is one line."""
    out = tmp_path / "sampling.json"
    done = run_tool(ROOT / "tools" / "bench_sampling.py", "--model", tiny_model_dir, "--requests", "4",
                    "--prompt-tokens", "8", "--new-tokens", "16", "--truncations", "top_k=5", "--repeats", "1",
                    "--json", out, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    figures = json.loads(out.read_text())
    supported = figures["variants"]["top_k=5/support"]
    assert 1 <= supported["support_mean"] <= supported["support_max"] <= 5
    assert supported["reply_bytes_per_token"] == 4 * supported["support_mean"]
    assert "support_mean" not in figures["variants"]["top_k=5/logprob"]
    assert done.stdout.splitlines()[-1].startswith("support_mask_over_log_softmax=")
    bad = run_tool(ROOT / "tools" / "bench_sampling.py", "--truncations", "top_k=1", timeout=120)
    assert bad.returncode != 0 and "top_k=1" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
