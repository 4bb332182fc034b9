"""A model's HF tensors written as an HF folder (``tools/export_hf.py``): safetensors shards of a bounded
size with their index, the model's config and tokenizer files copied beside them, and the folder moved
into place whole at the end."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# copied from the HF model folder besides config.json (tokenizer files of the common tokenizer types)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")
OPTIONAL_FILES = ("generation_config.json",)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ShardWriter:
    """Writes ``(name, tensor)`` pairs into safetensors files of at most ``max_bytes`` (a larger tensor
    goes alone). Only the current file's tensors are held; each file is written when full."""

    def __init__(self, folder: Path, max_bytes: int, dtype):
        self.folder, self.max_bytes, self.dtype = folder, max_bytes, dtype
        self.pending: list = []
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.seen: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, tensor) -> None:
        if name in self.seen:
            raise RuntimeError(f"tensor {name} produced twice")
        self.seen.add(name)
        tensor = tensor.detach().to("cpu", self.dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.untyped_storage().nbytes() != nbytes:
            tensor = tensor.clone()  # a view of a fused tensor: keep only its own bytes (and let the rest go)
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending.append((name, tensor))
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"part-{len(self.files) + 1:05d}.safetensors"
        save_file(dict(self.pending), str(self.folder / name), metadata={"format": "pt"})
        self.files.append((name, [tensor_name for tensor_name, _ in self.pending]))
        self.pending, self.pending_bytes = [], 0

    def finish(self) -> list[str]:
        """Write what is left and give the files their HF names (with an index when there are several)."""
        self.flush()
        if not self.files:
            raise RuntimeError("the model produced no tensors")
        if len(self.files) == 1:
            os.replace(self.folder / self.files[0][0], self.folder / SINGLE_FILE)
            return [SINGLE_FILE]
        count = len(self.files)
        weight_map, names = {}, []
        for number, (temporary, tensor_names) in enumerate(self.files, start=1):
            final = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / temporary, self.folder / final)
            weight_map.update({tensor_name: final for tensor_name in tensor_names})
            names.append(final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names + [INDEX_FILE]


def copy_model_files(model_dir: Path, folder: Path, dtype: str) -> list[str]:
    """config.json (its dtype set to the written one), tokenizer files and generation_config.json."""
    hf_config = json.loads((model_dir / "config.json").read_text())
    keys = [key for key in ("dtype", "torch_dtype") if key in hf_config] or ["torch_dtype"]
    if any(hf_config.get(key) != dtype for key in keys):
        hf_config.update({key: dtype for key in keys})
        (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    else:
        shutil.copy2(model_dir / "config.json", folder / "config.json")
    copied = ["config.json"]
    for path in sorted(model_dir.iterdir()):
        wanted = (path.name in TOKENIZER_FILES or path.name in OPTIONAL_FILES or path.suffix == ".tiktoken"
                  or (path.name.startswith("tokenizer") and path.suffix in (".json", ".model", ".txt")))
        if wanted and path.is_file():
            shutil.copy2(path, folder / path.name)
            copied.append(path.name)
    if not any(name in TOKENIZER_FILES or name.startswith("tokenizer") or name.endswith(".tiktoken")
               for name in copied):
        print(f"[export] warning: no tokenizer files in {model_dir}; the export has none", flush=True)
    return copied


def put_in_place(temporary: Path, out: Path) -> None:
    """Rename the finished folder to ``out`` (replacing an existing one only after it is complete)."""
    old = None
    if out.is_dir():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.replaced-{os.getpid()}"
            os.replace(out, old)
        else:
            out.rmdir()
    os.replace(temporary, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- one torchrun rank
