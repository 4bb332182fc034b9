"""The GPU check: one prepared, offline call that turns a machine with an NVIDIA GPU into figures.

Written for the machine this project is sometimes lent (one H200; Python 3.12 with a CUDA torch and
transformers, but no megatron-core, SGLang or Transformer Engine; no package index; the working tree
and at most 64 MiB carried with it), and for any full GPU environment.

  here (CPU, PyPI):   python tools/gpu_check.py --prepare     the wheel set, in .gpu_wheels (ignored by git)
                      python tools/gpu_check.py --dry-run     the wheel set, its install into a Python 3.12
                                                              target without an index, and what would run
  there:              bash tools/gpu_check.sh --out "$OUT"    (device: carry=[".gpu_wheels"])

The wheel set is megatron-core for CPython 3.12 and this project as a wheel (installed there with
``--no-index --no-deps --target``: nothing else is needed that the image lacks). The run installs it
when megatron-core is missing, prints the versions found (they are not the CPU pins: torch 2.11,
transformers 5.17 there), runs the GPU subset (tests/test_gpu.py, once, every test's outcome read
from pytest's JUnit XML) and the pure-math tests on this machine, and reports each part PASS / FAIL /
NOT RUN with its reason and figures, in OUT/gpu_check.log and OUT/gpu_check.json (OUT: --out, else
$OUT, else runs/gpu_check). A part whose tests were all skipped is NOT RUN with their reasons (no
CUDA device, SGLang's CUDA kernels or Transformer Engine not installed, no FP8); a part not written yet
says so. Exit status: 0 every part passed, 1 a part failed, 2 none failed but one was NOT RUN
(--dry-run: 0 when the wheel set is ready and installs, 1 otherwise).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from sparse_rl_mega.runtime.paths import ROOT  # (the package's only module it imports)

WHEELS = ROOT / ".gpu_wheels"
CARRY_LIMIT = 64 * 2**20  # what the lent machine takes with the working tree (the tree counts too)
MEGATRON = "megatron-core==0.16.1"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
# pure modules that need neither SGLang nor MLflow (absent on the lent machine; test_config's launches import them)
CPU_TESTS = "tests/test_correction.py tests/test_kv_policies.py tests/test_hf_map.py"
GPU_SUBSET_LIMIT_S, CPU_TESTS_LIMIT_S = 360, 120  # with the install and imports: well inside 10 minutes
GPU_TESTS = "tests/test_gpu.py"

# the GPU parts: (name, test functions of tests/test_gpu.py, why NOT RUN when no test of it exists yet)
PARTS = [
    ("learner local spec on CUDA, fp32 and bf16, vs transformers",
     ["test_learner_local_spec_on_cuda_against_transformers"], None),
    ("learner step's gradient on CUDA (fp32) vs autograd", ["test_learner_gradient_on_cuda_equals_autograd"], None),
    ("learner at TP2 on one GPU", [], "NCCL refuses two ranks on one GPU; a gloo layout with CUDA tensors is not "
                                     "written"),
    ("learner with Transformer Engine (fp32, bf16) and FP8", ["test_learner_with_transformer_engine", "test_learner_fp8"],
     None),
    ("KV policies' scoring and the correction on CUDA vs CPU",
     ["test_policies_choose_the_same_tokens_on_cuda", "test_window_attention_mass_on_cuda",
      "test_correction_on_cuda_equals_cpu"], None),
    ("SGLang engine on the GPU with eviction (default backend, triton, flashinfer; CUDA graphs) vs the reference decoder",
     ["test_engine_on_gpu_matches_reference_decoder"], None),
    ("weight push into a GPU engine (CUDA IPC buckets, broadcast)", ["test_engine_on_gpu_takes_flattened_buckets"],
     None),
    ("trainer's push (WeightPush) over NCCL to a separate engine, 2 GPUs",
     ["test_trainer_pushes_over_nccl_to_a_separate_engine"], None),
    ("learner step on a ~1B Llama shape: tokens/s, MFU, peak memory vs --plan",
     ["test_learner_step_throughput_and_memory_against_the_plan"], None),
    ("flattened push buckets over CUDA IPC to another process, vs a device copy",
     ["test_flattened_buckets_reach_another_process_over_cuda_ipc"], None),
]
FIGURE_PREFIXES = {"STEP_FIGURES ": "step", "IPC_FIGURES ": "ipc", "GRAD_FIGURES ": "gradient", "PUSH_FIGURES ": "push"}  # figures the GPU tests print (test_gpu.py)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--prepare", action="store_true", help="build the wheel set (needs pip and a package index)")
    mode.add_argument("--dry-run", action="store_true",
                      help="--prepare, check it installs into a Python 3.12 target, report what would run")
    p.add_argument("--out", default=None, help="folder of the log and JSON (default: $OUT, else runs/gpu_check)")
    p.add_argument("--wheels", default=str(WHEELS), help="the wheel set's folder (default: %(default)s)")
    p.add_argument("--cpu-tests", default=os.environ.get("GPU_CHECK_CPU_TESTS", CPU_TESTS),
                   help="the pure-math test paths run on this machine, space-separated (default: %(default)s)")
    return p.parse_args(argv)


class Report:
    """The check's lines (console and log) and figures (JSON)."""

    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "gpu_check.log"
        self.log_path.write_text("")
        self.figures: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}}

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log(line)

    def log(self, text: str) -> None:
        with self.log_path.open("a") as f:
            f.write(text.rstrip("\n") + "\n")

    def part(self, name: str, status: str, reason: str = "", **figures) -> None:
        self.figures["parts"][name] = {"status": status, "reason": reason, **figures}
        self.say(f"[gpu_check] {status} {name}" + (f": {reason}" if reason else ""))

    def write(self) -> Path:
        path = self.out / "gpu_check.json"
        path.write_text(json.dumps(self.figures, indent=1, default=str))
        return path


def run(command: list, report: Report, timeout: int) -> subprocess.CompletedProcess:
    """``command`` with its output in the log, in its own process group; at ``timeout`` the whole group
    is killed (pytest's torchrun ranks too) and the exit code is 124: a failed command, not a hang."""
    report.log("$ " + " ".join(str(c) for c in command))
    process = subprocess.Popen([str(c) for c in command], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        report.log(stdout + stderr + f"\ntimed out after {timeout} s")
        return subprocess.CompletedProcess(command, 124, stdout, stderr + f"\ntimed out after {timeout} s")
    report.log(stdout + stderr)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def last_line(done: subprocess.CompletedProcess) -> str:
    """What a failed command said last (its stderr's, else its stdout's last line)."""
    return ((done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"])[0]


# ----------------------------------------------------------------------------- the wheel set
def prepare(wheels: Path, report: Report) -> dict:
    """megatron-core for CPython 3.12 and this project as a wheel in ``wheels`` (replaced); their sizes."""
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    platforms = [arg for name in PLATFORMS for arg in ("--platform", name)]
    steps = [(f"download {MEGATRON} (CPython 3.12)",
              pip + ["download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                     "cp", *platforms, "-d", wheels, MEGATRON]),
             ("build this project's wheel", pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT])]
    for what, command in steps:
        done = run(command, report, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{what} failed: {last_line(done)} (log: {report.log_path})")
    files = {p.name: p.stat().st_size for p in sorted(wheels.glob("*.whl"))}
    total = sum(files.values())
    report.say(f"[gpu_check] wheel set {wheels}: {len(files)} wheels, {total / 2**20:.1f} MiB "
               f"(carried with the tree: at most {CARRY_LIMIT // 2**20} MiB together)")
    for name, size in files.items():
        report.say(f"  {name}: {size / 2**20:.2f} MiB")
    if total >= CARRY_LIMIT:
        raise RuntimeError(f"the wheel set is {total / 2**20:.1f} MiB, over the {CARRY_LIMIT // 2**20} MiB carried")
    return {"files": files, "bytes": total}


def install(wheels: Path, target: Path, python: str, report: Report) -> None:
    """Install every wheel of ``wheels`` into ``target`` with ``python``'s pip, without an index or
    dependencies (the machine has the rest)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise RuntimeError(f"no wheels in {wheels}: run `python tools/gpu_check.py --prepare` where pip reaches PyPI "
                           f"and carry the folder")
    done = run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
                "--no-compile", "--no-cache-dir", "--upgrade", "--target", target, *found], report, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"installing {wheels} into {target} failed: {last_line(done)}")


def python312() -> str | None:
    """A Python 3.12 interpreter on this machine, if any."""
    for candidate in ("python3.12", str(Path.home() / ".pyenv" / "versions" / "3.12.1" / "bin" / "python3.12")):
        path = shutil.which(candidate) or (candidate if Path(candidate).is_file() else None)
        if path:
            done = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                                  capture_output=True, text=True)
            if done.stdout.strip() == "True":
                return path
    return None


def dry_run(args, report: Report) -> int:
    report.figures["mode"] = "dry-run"
    try:
        report.figures["wheels"] = prepare(Path(args.wheels), report)
        python = python312()
        if python is None:
            report.say("[gpu_check] install check: no Python 3.12 here (the wheel set is for CPython 3.12): not checked")
            report.figures["install_check"] = "no Python 3.12 here"
        else:
            with tempfile.TemporaryDirectory() as target:
                install(Path(args.wheels), Path(target), python, report)
                installed = sorted(p.name for p in Path(target).iterdir() if not p.name.endswith(".dist-info"))
            report.say(f"[gpu_check] install check: the wheel set installs into a Python 3.12 target without an index "
                       f"({python}): {', '.join(installed)} (importing needs that machine's torch)")
            report.figures["install_check"] = {"python": python, "installed": installed}
    except RuntimeError as exc:
        report.say(f"[gpu_check] FAIL wheel set: {exc}")
        report.write()
        return 1
    report.say("[gpu_check] what would run there: `bash tools/gpu_check.sh --out $OUT` (carry .gpu_wheels), "
               "installing the wheel set where megatron-core is missing:")
    why = "no CUDA device here (dry run)" if not cuda_devices() else "dry run"
    for name, tests, not_written in PARTS:
        report.part(name, "NOT RUN", not_written or f"{why}; tests/test_gpu.py::{', '.join(tests)}")
    report.part("pure math on this machine", "NOT RUN", f"dry run; {args.cpu_tests}")
    report.write()
    return 0


# ----------------------------------------------------------------------------- the check
def cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def versions(report: Report) -> dict:
    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "megatron.core", "transformer_engine", "sglang", "sgl_kernel", "flashinfer",
                 "triton", "numpy"):
        try:
            with warnings.catch_warnings():  # (megatron-core's notices that TE and Apex are absent)
                warnings.simplefilter("ignore")
                found[name] = getattr(importlib.import_module(name), "__version__", "present")
        except Exception as exc:  # noqa: BLE001 (reported as found: not usable, and why)
            found[name] = f"not usable ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    import torch

    found["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        found["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    report.say("[gpu_check] found: " + ", ".join(f"{k} {v}" for k, v in found.items()))
    pins = {"torch": "2.13.0", "transformers": "5.19.0", "megatron.core": "0.16.1"}  # the CPU venv's
    differs = {k: (found.get(k), v) for k, v in pins.items() if not str(found.get(k, "")).startswith(v)}
    if differs:
        report.say("[gpu_check] not the CPU pins: " + ", ".join(f"{k} {a} (CPU: {b})" for k, (a, b) in differs.items()))
    return found


def pytest_outcomes(paths: str, report: Report, timeout: int) -> tuple[dict, str]:
    """Run pytest on ``paths`` in this process's Python (in-process, no xdist); ``({test function:
    [(outcome, detail)]}, summary)`` from its JUnit XML (outcome passed / failed / skipped)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        done = run([sys.executable, "-m", "pytest", "-o", "addopts=", "-o", "junit_logging=all", "-q", "-rfEs",
                    "-p", "no:cacheprovider", f"--junitxml={xml}", *paths.split()], report, timeout)
        if done.returncode == 124:
            return {}, f"timed out after {timeout} s"
        if not xml.exists():
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return {}, f"pytest exit code {done.returncode}, no results: {' | '.join(tail)}"
        outcomes: dict = {}
        for case in ElementTree.parse(xml).iter("testcase"):
            function = case.get("name", "").split("[")[0]
            outcome, detail = "passed", ""
            for kind in ("failure", "error", "skipped"):
                node = case.find(kind)
                if node is not None:
                    outcome = "skipped" if kind == "skipped" else "failed"
                    detail = (node.get("message") or "").replace("\n", " ")[:300]
            out = case.find("system-out")
            outcomes.setdefault(function, []).append((outcome, detail, out.text if out is not None and out.text else ""))
    lines = done.stdout.strip().splitlines()
    return outcomes, lines[-1] if lines else f"pytest exit code {done.returncode}"


def judge(tests: list, outcomes: dict) -> tuple[str, str, dict]:
    """A part's status, reason and counts from its tests' outcomes."""
    results = [r for test in tests for r in outcomes.get(test, [])]
    counts = {kind: sum(r[0] == kind for r in results) for kind in ("passed", "failed", "skipped")}
    skipped = sorted({r[1].removeprefix("Skipped: ") for r in results if r[0] == "skipped"})
    if counts["failed"]:
        return "FAIL", "; ".join(r[1] for r in results if r[0] == "failed")[:600], counts
    if not counts["passed"]:
        return "NOT RUN", "; ".join(skipped) or "no test of it ran", counts
    return "PASS", ("skipped: " + "; ".join(skipped)) if skipped else "", counts


def printed_figures(tests: list, outcomes: dict) -> dict:
    """What a part's tests printed to report: the learner helper's check lines (bounds and gaps), the
    step's figures."""
    printed = "".join(r[2] for test in tests for r in outcomes.get(test, []))
    figures = {}
    checks = [line for line in printed.splitlines() if line.split(" ")[0] in ("PASS", "FAIL", "SKIP", "INFO")]
    if checks:
        figures["learner_report"] = checks
    for line in printed.splitlines():
        for prefix, key in FIGURE_PREFIXES.items():
            if line.startswith(prefix):
                figures[key] = json.loads(line[len(prefix):])
    return figures


def step_summary(step: dict) -> str:
    """One line of the step's figures."""
    line = (f"{step['tokens_per_s']:.0f} tokens/s, {step['tflops']:.0f} TFLOP/s, MFU {step['mfu']:.1%} "
            f"({step['params'] / 1e9:.2f} B parameters, {step['dtype']}, 2 x {step['seq']} tokens a step)")
    if step.get("peak_allocated_bytes"):
        line += (f"; peak memory {step['peak_allocated_bytes'] / 2**30:.1f} GiB, --plan "
                 f"{step['plan_bytes']['total'] / 2**30:.1f} GiB ({step['peak_over_plan']:.2f}x)")
    return line


def ipc_summary(ipc: dict) -> str:
    """One line of the hand-over's figures."""
    return (f"{ipc['tensors']} tensors in {ipc['buckets']} buckets ({ipc['bytes'] / 2**30:.2f} GiB {ipc['dtype']}) "
            f"by {ipc['transport']}: bit for bit {ipc['bit_exact']}; copied out at {ipc['handover_gb_per_s']:.0f} GB/s "
            f"against {ipc['device_copy_gb_per_s']:.0f} GB/s for a device copy ({ipc['handover_over_copy']:.2f}x its time)")


def check(args, report: Report) -> int:
    report.figures["mode"] = "check"
    wheels = Path(args.wheels)
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        site = Path(tempfile.gettempdir()) / "gpu_check_site"
        try:
            install(wheels, site, sys.executable, report)
        except RuntimeError as exc:
            report.say(f"[gpu_check] FAIL install: {exc}")
            report.write()
            return 1
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        importlib.invalidate_caches()
        report.say(f"[gpu_check] installed the wheel set {wheels} into {site}")
    report.figures["versions"] = versions(report)
    started = time.perf_counter()
    if cuda_devices():
        outcomes, summary = pytest_outcomes(GPU_TESTS, report, timeout=GPU_SUBSET_LIMIT_S)
        report.say(f"[gpu_check] GPU subset ({GPU_TESTS}): {summary}")
    else:
        outcomes, summary = {}, "no CUDA device visible to torch"
    report.figures["gpu_subset_seconds"] = round(time.perf_counter() - started, 1)
    for name, tests, not_written in PARTS:
        if not_written:
            report.part(name, "NOT RUN", not_written)
        elif not outcomes:  # no CUDA device (NOT RUN), or pytest timed out or gave no results (FAIL)
            report.part(name, "NOT RUN" if summary == "no CUDA device visible to torch" else "FAIL", summary)
        else:
            status, reason, counts = judge(tests, outcomes)
            figures = printed_figures(tests, outcomes)
            report.part(name, status, reason, tests=counts, **figures)
            for line in figures.get("learner_report", []):
                report.say(f"  {line}")
            if "step" in figures:
                report.say(f"  {step_summary(figures['step'])}")
            if "ipc" in figures:
                report.say(f"  {ipc_summary(figures['ipc'])}")
    cpu, summary = pytest_outcomes(args.cpu_tests, report, timeout=CPU_TESTS_LIMIT_S)
    status, reason, counts = judge(list(cpu), cpu) if cpu else ("FAIL", summary, {})
    report.part("pure math on this machine", status, reason or summary, tests=counts)
    report.write()
    statuses = {part["status"] for part in report.figures["parts"].values()}
    report.say(f"[gpu_check] log: {report.log_path}; figures: {report.out / 'gpu_check.json'}")
    return 1 if "FAIL" in statuses else 2 if "NOT RUN" in statuses else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or ROOT / "runs" / "gpu_check")
    report = Report(out)
    os.environ.update(HF_HUB_OFFLINE="1", MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true",
                      SGLANG_USE_CPU_ENGINE="0")
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    if args.prepare:
        try:
            report.figures["wheels"] = prepare(Path(args.wheels), report)
        except RuntimeError as exc:
            report.say(f"[gpu_check] FAIL wheel set: {exc}")
            return 1
        report.write()
        return 0
    if args.dry_run:
        return dry_run(args, report)
    return check(args, report)


if __name__ == "__main__":  # (tools/gpu_check.sh: python -m, as the lent machine has no project installed)
    sys.exit(main())
