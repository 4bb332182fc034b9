"""Pre-flight (sparse_rl_mega/cli/preflight.py) and the model shape read from its folder: every mistake a new
user makes with the inputs is one line naming the key or file, exit status 2, before anything starts."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sparse_rl_mega.config import ArchConfig, ConfigError, config_from_dict, load_config
from sparse_rl_mega.cli.preflight import PromptTokenCounter, preflight, world_problems
from tests.conftest import ROOT, TRAIN_DATA, run_tool

CPU_TINY = ROOT / "examples" / "cpu_tiny.yaml"


def _variant(tmp_path, edit=lambda raw: None) -> Path:
    """examples/cpu_tiny.yaml with absolute paths, its model (create_tiny) and run folder under tmp_path."""
    raw = yaml.safe_load(CPU_TINY.read_text())
    raw["data"]["train_path"] = str(ROOT / raw["data"]["train_path"])
    raw["model"]["path"] = str(tmp_path / "model-built-by-the-first-run")
    raw["trainer"]["run_dir"] = str(tmp_path / "run")
    edit(raw)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _launch(*args):
    return run_tool(ROOT / "tools" / "launch.py", *map(str, args), timeout=120, warm=False)


def _error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def _tokenizer_folder(folder: Path, positions: int) -> Path:
    """A model folder as preflight sees it: config.json (``positions``), a weights file, and a real
    tokenizer whose post-processor adds a BOS token (as Llama's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "<unk>"] + [f"w{i}" for i in range(40)]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", unk_token="<unk>").save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": positions,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}))
    (folder / "model.safetensors").write_bytes(b"")  # (preflight looks for weights, it does not read them)
    return folder


# ----------------------------------------------------------------------------- model.arch from the folder


def test_arch_read_from_a_transformers_saved_qwen2_folder_equals_the_one_written_by_hand(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=1000, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=4096, rope_theta=50000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=True).save_pretrained(tmp_path)
    by_hand = ArchConfig(family="qwen2", num_layers=3, hidden_size=96, ffn_hidden_size=160, num_attention_heads=6,
                         num_query_groups=2, vocab_size=1000, max_position_embeddings=4096,
                         rope_theta=50000.0, norm_eps=1e-5, tie_word_embeddings=True)
    raw = {"model": {"path": str(tmp_path)}, "data": {"train_path": "x.jsonl"}}
    cfg = config_from_dict(raw)
    assert cfg.model.arch == by_hand
    assert "family" in cfg.arch_from_folder and "num_layers" in cfg.arch_from_folder
    # a field that is written stays as written, and is checked against the folder as before
    raw["model"]["arch"] = {"num_query_groups": 3}
    with pytest.raises(ConfigError, match=r"model\.arch\.num_query_groups: 3 disagrees with .*config\.json \(2\)"):
        config_from_dict(raw)
    raw["model"]["arch"] = {"num_layers": 3}
    assert config_from_dict(raw).arch_from_folder == [n for n in config_from_dict({**raw, "model": {
        "path": str(tmp_path)}}).arch_from_folder if n != "num_layers"]


def test_arch_without_a_folder_to_read_it_from_is_an_error(tmp_path):
    raw = {"model": {"path": str(tmp_path / "absent")}, "data": {"train_path": "x.jsonl"}}
    with pytest.raises(ConfigError, match=r"model\.arch: not given, and .*config\.json does not exist here"):
        config_from_dict(raw)
    raw["model"]["create_tiny"] = {}  # built from model.arch's defaults
    assert config_from_dict(raw).model.arch == ArchConfig()


def test_head_dim_is_checked_against_a_folder_without_head_dim(tmp_path):
    """HF derives the head width as hidden_size / num_attention_heads when config.json has no head_dim."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384}))
    path = _variant(tmp_path, lambda raw: raw["model"].update(path=str(folder)))
    assert load_config(path).model.arch.kv_channels == 16
    with pytest.raises(ConfigError, match=r"model\.arch\.head_dim: heads of width 32 disagree with .* \(heads of width "
                                          r"16 = hidden_size / num_attention_heads\)"):
        load_config(path, ["model.arch.head_dim=32"])


# ----------------------------------------------------------------------------- data files


def test_bad_data_rows_stop_the_launch_naming_file_and_line(tmp_path):
    data = tmp_path / "train.jsonl"
    good = TRAIN_DATA.read_bytes().splitlines()[:2]
    data.write_bytes(b"\n".join(good + [b'{"prompt": "caf\xff", "label": "1"}', b"", b'{"prompt": "   ", "label": "2"}',
                                        b'{"prompt": "3 + 4 =", "label": " "}',
                                        b'{"question": "3 + 4 =", "answer": "7"}']) + b"\n")
    path = _variant(tmp_path, lambda raw: raw["data"].update(train_path=str(data)))
    for flags in ([], ["--dry-run"]):
        proc = _launch(path, *flags)
        assert proc.returncode == 2, proc.stderr
        message = proc.stderr
        assert f"data.train_path: {data}: 4 bad row(s)" in message
        assert f"{data}:3: not UTF-8 (byte 0xff at byte 16 of the line)" in message
        assert f"{data}:5: key 'prompt' must be a string that is not blank, got '   '" in message
        assert f"{data}:6: key 'label' must be a number or a string that is not blank" in message
        assert (f"{data}:7: key 'prompt' is missing (the row has 'question', 'answer'): data.prompt_key names the "
                "row's key for it; raw question/answer rows: data.format: question_answer") in message
        assert "Traceback" not in message
    assert not (tmp_path / "run").exists() and not (tmp_path / "model-built-by-the-first-run").exists()


def test_absent_inputs_are_listed_by_the_dry_run_and_stop_a_launch(tmp_path):
    path = _variant(tmp_path, lambda raw: (raw["model"].update(path=str(tmp_path / "no-model"), create_tiny=None),
                                           raw["data"].update(train_path=str(tmp_path / "no.jsonl"))))
    dry = _launch(path, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"not on this machine, not checked: model.path: {tmp_path / 'no-model'} does not exist" in dry.stdout
    assert f"not on this machine, not checked: data.train_path: {tmp_path / 'no.jsonl'} is not a file" in dry.stdout
    proc = _launch(path)
    assert proc.returncode == 2
    lines = _error_lines(proc)
    assert len(lines) == 2 and "model.path" in lines[0] and "data.train_path" in lines[1], proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_model_folder_without_weights_or_tokenizer(tmp_path):
    folder = _tokenizer_folder(tmp_path / "model", positions=512)
    (folder / "model.safetensors").unlink()
    cfg = load_config(_variant(tmp_path, lambda raw: raw["model"].update(path=str(folder))))
    assert preflight(cfg).problems == [f"model.path: {folder} has no weights (*.safetensors or pytorch_model*.bin)"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    assert f"model.path: {folder} has no tokenizer" in preflight(cfg).problems[-1]


# ----------------------------------------------------------------------------- lengths


def test_prompt_tokens_are_counted_as_the_engine_receives_them(tmp_path):
    """The fast count (tokenizers, no transformers) equals encode_prompt on transformers' tokenizer, with
    the BOS added by the post-processor and not added to a prompt that already begins with it."""
    from transformers import AutoTokenizer

    from sparse_rl_mega.data.formatting import encode_prompt

    folder = _tokenizer_folder(tmp_path / "model", positions=512)
    reference = AutoTokenizer.from_pretrained(folder)
    counter = PromptTokenCounter(folder)
    for prompt in ("w1 w2 w3", "<s> w1 w2", "w5 unknown w7 w8 w9", "<s>w1"):
        assert counter.count(prompt) == len(encode_prompt(reference, prompt)), prompt
    assert counter.longest(["w1", "w1 w2 w3", "w2"], ["a:1", "a:2", "a:3"]) == (4, "a:2")


def test_max_new_tokens_must_fit_what_sglang_generates_after_the_longest_prompt(tmp_path):
    """SGLang 0.5.23 generates at most positions - prompt - 2 tokens (more are cut without a word) and
    refuses prompts of positions - 6 tokens or more (preflight.response_room, measured in
    tests/test_evaluate.py): exactly that much passes, one more token fails naming the key."""
    positions = 64
    folder = _tokenizer_folder(tmp_path / "model", positions=positions)
    data = tmp_path / "train.jsonl"
    prompts = ["w1 w2", " ".join(f"w{i}" for i in range(20)), "w3"]
    data.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in prompts))
    longest = 21  # BOS + 20 words, on line 2
    arch = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                vocab_size=384, max_position_embeddings=positions)
    path = _variant(tmp_path, lambda raw: (raw["model"].update(path=str(folder), arch=arch, create_tiny=None),
                                           raw["data"].update(train_path=str(data))))
    fits = positions - longest - 2
    assert preflight(load_config(path, [f"rollout.max_new_tokens={fits}"])).problems == []
    assert preflight(load_config(path, [f"rollout.max_new_tokens={fits + 1}"])).problems == [
        f"rollout.max_new_tokens: {fits + 1} new tokens do not fit after the longest prompt ({longest} tokens, {data}:2) "
        f"in the model's {positions} positions (model.arch.max_position_embeddings): SGLang generates at most {fits} "
        "(positions - prompt - 2)"]
    # a smaller KV pool bounds a request too
    pool = [f"rollout.max_total_tokens={positions - 4}", f"rollout.max_new_tokens={fits}"]
    assert "in the KV pool's 60 slots (rollout.max_total_tokens): SGLang generates at most 37" in \
        preflight(load_config(path, pool)).problems[0]
    evaluated = [f"eval.path={data}", "eval.n_samples=1", "eval.temperature=0", "rollout.max_new_tokens=8"]
    assert preflight(load_config(path, evaluated + [f"eval.max_new_tokens={fits}"])).problems == []
    problems = preflight(load_config(path, evaluated + [f"eval.max_new_tokens={fits + 1}"])).problems
    assert len(problems) == 1 and problems[0].startswith(f"eval.max_new_tokens: {fits + 1} new tokens"), problems
    # a prompt SGLang refuses, whatever max_new_tokens
    data.write_text(json.dumps({"prompt": " ".join(f"w{i % 40}" for i in range(positions - 7)), "label": "1"}) + "\n")
    assert preflight(load_config(path, ["rollout.max_new_tokens=1"])).problems == [
        f"rollout: the longest prompt ({positions - 6} tokens, {data}:1) does not fit the model's {positions} positions "
        f"(model.arch.max_position_embeddings): SGLang takes prompts of at most {positions - 7} tokens"]
    # no room for any prompt: caught from the config alone (the model need not exist yet)
    proc = _launch(_variant(tmp_path), "--dry-run", "--set", "rollout.max_new_tokens=510")
    assert proc.returncode == 2 and _error_lines(proc) == [
        f"config error: {tmp_path / 'variant.yaml'}: rollout.max_new_tokens: 510 does not fit the model's 512 positions "
        "(model.arch.max_position_embeddings): SGLang generates at most 509, after a one-token prompt"]


@pytest.mark.parametrize("backend", ["fa3", "flashinfer", "triton", "torch_native"])
def test_a_gpu_attention_backend_on_a_cpu_is_one_line(tmp_path, monkeypatch, backend):
    """fa3 and flashinfer need an NVIDIA GPU: on a CPU machine pre-flight names the key; torch_native
    and triton (its kernels under Triton's interpreter) run there. On a GPU each of the four runs."""
    import torch

    cfg = load_config(_variant(tmp_path), [f"rollout.attention_backend={backend}"])
    problems = preflight(cfg, dry_run=True).problems
    expected = [f"rollout.attention_backend: {backend!r} needs an NVIDIA GPU: a CPU engine runs torch_native (the "
                "default) or triton (its kernels under Triton's interpreter, for tests: each kernel's programs one by "
                "one)"] if backend in ("fa3", "flashinfer") else []
    assert problems == expected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("sparse_rl_mega.cli.preflight.version_problems", lambda *args: [])
    assert preflight(cfg, dry_run=True).problems == []


def test_inputs_that_run_but_not_as_their_settings_say_are_warned_about(tmp_path):
    """A KV budget no request reaches (the longest prompt + max_new_tokens, with the interval: nothing
    is ever evicted) and a data file with fewer rows than one iteration's prompts run, each with one
    [warn] line before anything starts (the dry run prints them too)."""
    folder = _tokenizer_folder(tmp_path / "model", positions=512)
    data = tmp_path / "train.jsonl"
    prompts = [" ".join(f"w{i}" for i in range(20))] + [f"w{i}" for i in range(15)]  # one of 20 words, 15 of one
    data.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in prompts))
    arch = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                vocab_size=384, max_position_embeddings=512)
    path = _variant(tmp_path, lambda raw: (raw["model"].update(path=str(folder), arch=arch, create_tiny=None),
                                           raw["data"].update(train_path=str(data))))
    # the longest prompt: BOS + 20 words = 21 tokens; a request caches at most 21 + 24 - 1 = 44
    assert preflight(load_config(path, ["rollout.kv_compression.budget=42"])).warnings == []
    checked = preflight(load_config(path, ["rollout.kv_compression.budget=43", "data.prompts_per_iteration=32"]))
    assert checked.problems == [] and checked.warnings == [
        "rollout.kv_compression.budget: 43 + interval 2 exceeds the longest prompt (21 tokens) + "
        "rollout.max_new_tokens (24): no request is ever compressed, the run decodes dense",
        f"data.train_path: 16 row(s) in {data}, fewer than data.prompts_per_iteration=32: every batch repeats prompts"]
    dry = _launch(path, "--dry-run", "--set", "rollout.kv_compression.budget=4096")
    assert dry.returncode == 0 and "[warn] rollout.kv_compression.budget: 4096 + interval 2 exceeds" in dry.stdout, \
        dry.stdout + dry.stderr


# ----------------------------------------------------------------------------- torchrun's world


def test_torchrun_process_counts_against_the_config():
    cfg = load_config(CPU_TINY)
    assert world_problems(cfg, {}) == [] and world_problems(cfg, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}) == []
    assert world_problems(cfg, {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}) == [
        "parallel.nproc_per_node: 2 processes per node, but torchrun started 1 on this node: start it with "
        "--nproc-per-node 2 (or change parallel.nproc_per_node)"]
    assert "torchrun started 4 in all" in world_problems(cfg, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})[0]


@pytest.mark.launch  # (a real torchrun: not in the unit tier)
def test_torchrun_with_the_wrong_process_count_prints_one_line(tmp_path):
    """torchrun's agent would add a 30-line report of the failed worker: the worker ends it instead."""
    from sparse_rl_mega.runtime.ports import free_port

    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "3", "--master-port", str(free_port()),
                           str(ROOT / "tools" / "launch.py"), str(_variant(tmp_path))],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -9, proc.stderr  # (the agent, killed)
    assert _error_lines(proc) == [
        f"config error: {tmp_path / 'variant.yaml'}: parallel.nproc_per_node: 2 processes per node, but torchrun "
        "started 3 on this node: start it with --nproc-per-node 2 (or change parallel.nproc_per_node)"], proc.stderr
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- the tracking server


def test_a_tracking_server_that_does_not_answer_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    """MLflow's client retries an unreachable server for minutes (a launch failed after 258 s): its
    ``/health`` is asked first, with a bound; a local store is not asked."""
    import http.server
    import threading

    from sparse_rl_mega.runtime.ports import free_port

    for proxy in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(proxy, raising=False)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # (http.server's name)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", free_port()), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        answering = f"http://127.0.0.1:{server.server_port}"
        assert preflight(load_config(CPU_TINY, [f"tracking.tracking_uri={answering}"])).problems == []
    finally:
        server.shutdown()
        server.server_close()
    closed = f"http://127.0.0.1:{free_port()}"  # (nothing listens there)
    cfg = load_config(CPU_TINY, [f"tracking.tracking_uri={closed}"])
    expected = (f"tracking.tracking_uri: the MLflow server {closed} does not answer ([Errno 111] Connection refused): "
                "start it, fix the URI, or set tracking.enabled: false")
    assert preflight(cfg).problems == [expected]
    assert preflight(cfg, dry_run=True).not_here == [expected] and preflight(cfg, dry_run=True).problems == []
    assert preflight(load_config(CPU_TINY, [f"tracking.tracking_uri={closed}", "tracking.enabled=false"])).problems == []
    assert preflight(load_config(CPU_TINY, [f"tracking.tracking_uri={closed}"]), environ={"RANK": "1"}).problems == []


def test_a_mismatched_gpu_stack_is_named_in_one_line_each():
    """What SGLang 0.5.23 and Megatron-Core 0.16.1 require, checked before anything starts: a GPU run
    with another torch, a missing sglang-kernel, a Transformer Engine outside Megatron's tested range or
    without transformer_engine.pytorch.fp8 (Megatron would take TE as absent) each gives one line."""
    from sparse_rl_mega.runtime.versions import GPU_STACK, version_problems

    good = {"torch": "2.14.1+cu130", "megatron-core": "0.16.1", "sglang": "0.5.23", "sglang-kernel": "0.4.10",
            "flashinfer-python": "0.7.2", "cuda-python": "13.0.3", "transformer-engine": "2.10.0"}
    assert set(GPU_STACK) <= set(good)
    assert version_problems(True, True, good.get, lambda name: True) == []
    assert version_problems(False, True, {"megatron-core": "0.16.1", "sglang": "0.5.23"}.get) == []  # (the CPU venv)
    bad = {**good, "torch": "2.13.0+cu128", "transformer-engine": "2.12.1"}
    bad.pop("sglang-kernel")
    problems = version_problems(True, True, bad.get, lambda name: False)
    assert problems == ["torch 2.13.0+cu128 is installed; this project was written for torch==2.14.1",
                        "sglang-kernel is not installed; this project needs sglang-kernel==0.4.10 (pip install -e .[gpu])",
                        "transformer-engine 2.12.1 is installed; this project was written for "
                        "transformer-engine>=2.9.0a0,<2.12",
                        "transformer_engine.pytorch.fp8 is missing from the installed Transformer Engine: "
                        "Megatron-Core 0.16.1 would then take Transformer Engine as absent (model.transformer_impl)"]
    assert version_problems(False, False, {**good, "megatron-core": "0.17.0"}.get) == [
        "megatron-core 0.17.0 is installed; this project was written for megatron-core==0.16.1"]
