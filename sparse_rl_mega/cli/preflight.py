"""Pre-flight: the inputs a run reads, checked before any process starts.

:func:`validate` (config/validation.py) checks the config itself; this checks it against the files it names:

* the data files (``data.train_path``, ``eval.path``): they exist, are UTF-8 jsonl, every row is valid
  and no prompt is blank (file and line named);
* the model folder: config.json, weights and a tokenizer (unless ``model.create_tiny`` builds it);
* lengths: the longest prompt plus ``max_new_tokens`` fits what SGLang generates on the model
  (:func:`response_room`: positions - prompt - 2), for the rollouts and the held-out evaluation;
* under torchrun, the processes it started against the config's ``parallel`` section;
* an MLflow tracking server (``tracking.tracking_uri``) answers.

``tools/launch.py`` runs it before it starts anything (every failure one line naming the key or file,
exit status 2); ``--dry-run`` runs it on the inputs that exist on this machine and lists the others as
not checked (a cluster config is checked on a laptop). Nothing here imports torch or transformers:
a mistake is reported within a second or two.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from collections.abc import Sequence

from sparse_rl_mega.config import RunConfig
from sparse_rl_mega.data.jsonl import DataError, PromptDataset, load_prompt_dataset
from sparse_rl_mega.kv.engine_settings import attention_backend_problem
from sparse_rl_mega.runtime.checkpoint_files import checkpoint_folder, config_changes, find_checkpoint, read_marker
from sparse_rl_mega.runtime.versions import version_problems

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class Preflight:
    problems: list[str] = field(default_factory=list)  # one line each: "KEY: what is wrong (what to do)"
    not_here: list[str] = field(default_factory=list)  # inputs absent on this machine (--dry-run only)
    warnings: list[str] = field(default_factory=list)  # inputs that run, but not as their settings say


def preflight(cfg: RunConfig, dry_run: bool = False, environ: Optional[dict] = None) -> Preflight:
    """Every check of this module on ``cfg``. ``dry_run``: an absent input is listed in ``not_here``
    rather than as a problem. ``environ`` (default ``os.environ``): torchrun's variables, when set."""
    report = Preflight()
    environ = os.environ if environ is None else environ

    def absent(line: str) -> None:  # (an input this machine cannot see: a problem unless dry_run)
        (report.not_here if dry_run else report.problems).append(line)

    report.problems += world_problems(cfg, environ)
    import torch  # (here: tools/launch.py imports this module before it sets the thread counts torch reads)

    report.problems += version_problems(torch.cuda.is_available(), cfg.model.transformer_impl == "transformer_engine")
    backend = attention_backend_problem(cfg.rollout.attention_backend, on_cpu=not torch.cuda.is_available())
    if backend:
        report.problems.append(f"rollout.attention_backend: {backend}")
    unreachable = tracking_problem(cfg) if environ.get("RANK", "0") == "0" else None  # (rank 0 alone tracks)
    if unreachable:
        absent(unreachable)
    model_ready = check_model_folder(cfg, report, absent)
    mismatch = resume_problem(cfg)
    if mismatch:
        report.problems.append(mismatch)
    datasets = load_datasets(cfg, report, absent, model_ready)
    if model_ready and not report.problems:
        report.problems += length_problems(cfg, datasets, report.warnings)
    train = datasets.get("data.train_path")
    if train is not None and len(train.records) < cfg.data.prompts_per_iteration:
        report.warnings.append(f"data.train_path: {len(train.records)} row(s) in {cfg.data.train_path}, fewer than "
                               f"data.prompts_per_iteration={cfg.data.prompts_per_iteration}: every batch repeats "
                               f"prompts")
    return report


def resume_problem(cfg: RunConfig) -> Optional[str]:
    """``checkpoint.resume``: the checkpoint it would load (the newest complete one) must hold a model of
    the config's shape (``model.arch`` as saved in its marker); otherwise its load fails in every rank
    after the engines and the learner started. None when it fits or nothing is resumed."""
    if cfg.checkpoint.resume is None:
        return None
    try:
        path = find_checkpoint(cfg.checkpoint.resume, checkpoint_folder(cfg))
    except FileNotFoundError as exc:
        return str(exc)
    saved = ((read_marker(path).get("config") or {}).get("model") or {}).get("arch") if path is not None else None
    if not saved:
        return None
    current = cfg.to_dict()["model"]["arch"]
    changes = config_changes(_shape(saved), _shape(current), "model.arch.")
    if not changes:
        return None
    return (f"checkpoint.resume: {path} holds another model than this config's ({'; '.join(changes[:4])}"
            f"{'; ...' if len(changes) > 4 else ''}): resume it with the config that saved it, or give this one a new "
            f"trainer.run_dir")


def _shape(arch: dict) -> dict:
    """What a checkpoint's tensors depend on, from a resolved ``model.arch``: its sizes and the width of a
    head (``head_dim``, else ``hidden_size / num_attention_heads``)."""
    shape = {key: arch.get(key) for key in ("family", "num_layers", "hidden_size", "ffn_hidden_size",
                                            "num_attention_heads", "num_query_groups", "vocab_size")}
    heads = arch.get("num_attention_heads") or 1
    shape["head_dim"] = arch.get("head_dim") or (arch.get("hidden_size") or 0) // heads
    return shape


def world_problems(cfg: RunConfig, environ) -> list[str]:
    """Under torchrun (its WORLD_SIZE / LOCAL_WORLD_SIZE set): its process counts against the config."""
    p = cfg.parallel
    problems = []
    world, local = environ.get("WORLD_SIZE"), environ.get("LOCAL_WORLD_SIZE")
    if local is not None and int(local) != p.nproc_per_node:
        problems.append(f"parallel.nproc_per_node: {p.nproc_per_node} processes per node, but torchrun started "
                        f"{local} on this node: start it with --nproc-per-node {p.nproc_per_node} (or change "
                        f"parallel.nproc_per_node)")
    elif world is not None and int(world) != cfg.world_size:
        problems.append(f"parallel.nnodes: {p.nnodes} node(s) x {p.nproc_per_node} = {cfg.world_size} processes, but "
                        f"torchrun started {world} in all: start it with --nnodes {p.nnodes} --nproc-per-node "
                        f"{p.nproc_per_node} on every node (or change parallel.nnodes)")
    return problems


TRACKING_TIMEOUT_S = 3.0


def tracking_problem(cfg: RunConfig, timeout_s: float = TRACKING_TIMEOUT_S) -> Optional[str]:
    """An MLflow tracking server (``tracking.tracking_uri`` http(s)) that does not answer its ``/health``
    within ``timeout_s``, as one line; None when it answers, or for a local store (the run folder's
    sqlite, a file URI). Checked before anything starts: MLflow's own client retries for minutes."""
    import urllib.error
    import urllib.request

    uri = cfg.tracking.tracking_uri
    if not cfg.tracking.enabled or not uri or not uri.startswith(("http://", "https://")):
        return None
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as answer:
            if answer.status == 200:
                return None
            why = f"/health answered HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        why = f"/health answered HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:  # (refused, unknown host, timed out)
        why = str(getattr(exc, "reason", exc))
    return (f"tracking.tracking_uri: the MLflow server {uri} does not answer ({why}): start it, fix the URI, "
            "or set tracking.enabled: false")


def check_model_folder(cfg: RunConfig, report: Preflight, absent) -> bool:
    """The model folder: config.json (validate() has compared model.arch with it), weights, a tokenizer.
    Returns whether the folder is complete here (the prompt lengths can then be counted)."""
    m = cfg.model
    folder = Path(m.path)
    if not (folder / "config.json").is_file():
        if m.create_tiny is None:  # (a folder without config.json fails validate(), naming model.path)
            absent(f"model.path: {folder} does not exist (an HF model folder: config.json, weights, tokenizer)")
        return False  # (create_tiny: built by the first run, from model.arch)
    missing = []
    if not (any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))):
        missing.append(f"model.path: {folder} has no weights (*.safetensors or pytorch_model*.bin)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"model.path: {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    report.problems += missing
    return not missing


def load_datasets(cfg: RunConfig, report: Preflight, absent, model_ready: bool) -> dict:
    """``{key: PromptDataset}`` of the data files that exist and read cleanly; a bad file or row is a
    problem naming the key, the file and the line."""
    d = cfg.data
    datasets = {}
    if not Path(d.train_path).is_file():
        absent(f"data.train_path: {d.train_path} is not a file (a jsonl of prompts and labels)")
    elif model_ready or d.format == "prompt_label" or not d.apply_chat_template or d.tokenizer:
        try:  # (question_answer rows templated with model.path's tokenizer: checked once it exists)
            datasets["data.train_path"] = load_prompt_dataset(d, default_tokenizer=cfg.model.path)
        except DataError as exc:
            report.problems.append(f"data.train_path: {exc}")
    if cfg.eval.path:
        if not Path(cfg.eval.path).is_file():
            absent(f"eval.path: {cfg.eval.path} is not a file (a prompt_label jsonl; write held-out sets with "
                   "tools/prepare_data.py)")
        else:
            try:
                datasets["eval.path"] = PromptDataset(cfg.eval.path)
            except DataError as exc:
                report.problems.append(f"eval.path: {exc}")
    return datasets


def response_room(positions: int, prompt_tokens: int) -> int:
    """The most tokens SGLang 0.5.23 generates after a prompt of ``prompt_tokens`` when a request may
    hold ``positions`` tokens (the model's context length, or the KV pool if smaller); 0 when it refuses
    the prompt. Its scheduler takes ``max_req_len = positions - 1`` (managers/tp_worker.py), refuses a
    prompt of ``max_req_len - 5`` tokens or more (managers/utils.py: validate_input_length) and cuts
    max_new_tokens to ``max_req_len - prompt - 1`` without a word (Scheduler, before admission); the
    tokenizer manager's own check (prompt + max_new_tokens <= context length) is looser. Measured at
    each bound on the tiny model (context 512, and a 300-slot pool): tests/test_evaluate.py."""
    max_req_len = positions - 1
    if prompt_tokens >= max_req_len - 5:
        return 0
    return max_req_len - 1 - prompt_tokens


def length_problems(cfg: RunConfig, datasets: dict, warnings: Optional[list] = None) -> list[str]:
    """The longest prompt + ``max_new_tokens`` against what SGLang generates on this model (its positions,
    or the KV pool ``rollout.max_total_tokens`` if smaller: :func:`response_room`), for each setting of
    ``max_new_tokens`` (the held-out set's is the rollout's unless ``eval.max_new_tokens`` is set):
    beyond it SGLang cuts responses short without a word, or refuses the prompt. A KV budget that no
    request can reach (the longest prompt + ``max_new_tokens``) is a warning, added to ``warnings``."""
    counter = PromptTokenCounter(cfg.model.path)
    context, pool = cfg.model.arch.max_position_embeddings, cfg.rollout.max_total_tokens
    positions = min(context, pool) if pool else context
    limit = (f"the model's {context} positions (model.arch.max_position_embeddings)" if positions == context
             else f"the KV pool's {pool} slots (rollout.max_total_tokens)")
    settings = {"data.train_path": ("rollout.max_new_tokens", cfg.rollout.max_new_tokens)}
    if cfg.eval.max_new_tokens is not None:
        settings["eval.path"] = ("eval.max_new_tokens", cfg.eval.max_new_tokens)
    longest: dict[tuple, tuple[int, str]] = {}  # (key, new tokens) -> (tokens, "file:line") of the longest prompt
    for key, dataset in datasets.items():
        setting = settings.get(key, settings["data.train_path"])
        found = counter.longest([r.prompt for r in dataset.records], [r.source for r in dataset.records])
        longest[setting] = max(longest.get(setting, found), found)
    problems = []
    for (key, new_tokens), (tokens, where) in longest.items():
        room = response_room(positions, tokens)
        if room < 1:
            problems.append(f"{key.split('.')[0]}: the longest prompt ({tokens} tokens, {where}) does not fit {limit}: "
                            f"SGLang takes prompts of at most {positions - 7} tokens")
        elif new_tokens > room:
            problems.append(f"{key}: {new_tokens} new tokens do not fit after the longest prompt ({tokens} tokens, "
                            f"{where}) in {limit}: SGLang generates at most {room} (positions - prompt - 2)")
    kv = cfg.rollout.kv_compression
    train = longest.get(settings["data.train_path"]) if "data.train_path" in datasets else None
    if warnings is not None and kv.policy != "none" and train is not None and kv.auto_budget is None:
        most = train[0] + cfg.rollout.max_new_tokens - 1  # the most a request caches before its last token
        reach = kv.budget + 1 if kv.trigger == "newline" else kv.budget + kv.interval  # (kv.replay.should_compress)
        if reach > most:
            warnings.append(f"rollout.kv_compression.budget: {kv.budget} + interval {kv.interval} exceeds the longest "
                            f"prompt ({train[0]} tokens) + rollout.max_new_tokens ({cfg.rollout.max_new_tokens}): no "
                            f"request is ever compressed, the run decodes dense")
    return problems


class PromptTokenCounter:
    """Token counts of prompts as the engine receives them (``data.formatting.encode_prompt``: the
    tokenizer's special tokens, unless the prompt already begins with the BOS text), from the model
    folder's ``tokenizer.json`` with the ``tokenizers`` library (transformers' fast tokenizers run the
    same file; importing it would cost seconds); transformers' own tokenizer without a tokenizer.json."""

    def __init__(self, model_dir: str | Path):
        folder = Path(model_dir)
        self.bos = _bos_text(folder)
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            self._count = lambda text, special: len(tokenizer.encode(text, add_special_tokens=special).ids)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            self.bos = tokenizer.bos_token
            self._count = lambda text, special: len(tokenizer(text, add_special_tokens=special)["input_ids"])

    def count(self, prompt: str) -> int:
        return self._count(prompt, not (self.bos and prompt.startswith(self.bos)))

    def longest(self, prompts: Sequence[str], sources: Sequence[str]) -> tuple[int, str]:
        """``(tokens, source)`` of the longest prompt (one at a time: a batch would start the Rust
        library's thread pool in a process that forks the ranks afterwards)."""
        counts = [self.count(prompt) for prompt in prompts]
        best = max(range(len(counts)), key=counts.__getitem__)
        return counts[best], sources[best]


def _bos_text(folder: Path) -> Optional[str]:
    """The BOS token's text from tokenizer_config.json (a string, or a dict with ``content``)."""
    try:
        bos = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("bos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return bos.get("content") if isinstance(bos, dict) else bos
