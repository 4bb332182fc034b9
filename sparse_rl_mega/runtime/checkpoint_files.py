"""A run's checkpoint folders as files, without torch: where they are, which are complete (a marker
written last), their sizes and XXH3-64 digests, the newest one that verifies, the configs they were saved
with. The launcher, the tools and the fault injector read checkpoints through this module; saving and
loading the shards is ``sparse_rl_mega/learner/checkpoint.py``."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional
from collections.abc import Callable

import xxhash

MARKER = "sparse_rl_mega.json"

_NAME = re.compile(r"^iter_\d{7}$")  # a checkpoint folder (not a renamed or foreign one beside it)

_CHUNK = 8 << 20  # bytes read at a time for a digest



def complete_checkpoints(root: str | Path) -> list[Path]:
    """``iter_NNNNNNN`` folders under ``root`` that hold a marker, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.match(p.name) and (p / MARKER).is_file())



def checkpoint_bytes(path: str | Path) -> int:
    """Bytes of a checkpoint: from its marker's file list, else by walking the folder."""
    path = Path(path)
    try:
        files = read_marker(path).get("files")
    except (OSError, ValueError):
        files = None
    if files:
        return sum(size for size, _ in files.values())
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())



def digest_of(path: Path) -> str:
    """XXH3-64 of a file's bytes, as 16 hex digits (xxhash: ~19 GiB/s on one core here, 5x zlib's CRC-32,
    which cost ~9 % of a SmolLM2 save)."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()



def data_files(path: Path) -> list[str]:
    """Every file of a checkpoint but its marker, as paths relative to it, sorted."""
    return sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and f.name != MARKER)



def file_problem(path: Path, name: str, size: int, digest: Optional[str]) -> Optional[str]:
    """What is wrong with one recorded file (None: it matches); ``digest`` None: its size only."""
    f = path / name
    try:
        actual = f.stat().st_size
    except FileNotFoundError:
        return f"{f}: missing"
    if actual != size:
        return f"{f}: {actual} bytes, the marker records {size}"
    if digest is not None:
        got = digest_of(f)
        if got != digest:
            return f"{f}: XXH3 digest {got}, the marker records {digest}"
    return None



def verify(path: str | Path, full: bool = True, share: tuple[int, int] = (0, 1)) -> Optional[str]:
    """The first problem of a checkpoint (None: it verifies): an unreadable marker, a file missing, of
    another size or (``full``) another XXH3-64 digest than its marker records. ``share`` = (index, count):
    check only every count-th file from index (the ranks split a checkpoint's files). A checkpoint
    saved before files were recorded verifies by its marker alone."""
    path = Path(path)
    try:
        files = read_marker(path).get("files")
    except (OSError, ValueError) as exc:
        return f"{path / MARKER}: unreadable ({exc})"
    if files is None:
        return None
    index, count = share
    for name in sorted(files)[index::count]:
        size, digest = files[name]
        problem = file_problem(path, name, size, digest if full else None)
        if problem is not None:
            return problem
    return None



def config_digest(config: dict) -> str:
    """A short digest of a resolved config (``checkpoint.resume`` left out: resuming sets it)."""
    data = {**config, "checkpoint": {k: v for k, v in config.get("checkpoint", {}).items() if k != "resume"}}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]



def config_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """``key: old -> new`` for every config value that differs (``checkpoint.resume`` left out)."""
    out = []
    for key in dict.fromkeys([*saved, *current]):
        name = f"{prefix}{key}"
        old, new = saved.get(key), current.get(key)
        if name == "checkpoint.resume":
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            out += config_changes(old, new, f"{name}.")
        elif old != new:
            out.append(f"{name}: {old} -> {new}")
    return out

_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:\]\n]+)")  # how an OSError reads: "[Errno 28] No space left on device"



def _os_error(exc: BaseException) -> Optional[OSError]:
    """An OSError behind ``exc`` (its causes, contexts, arguments and ``failures``, and the tuples and
    dicts among them: torch's CheckpointException holds ``{rank: (exception, traceback)}``), or None."""
    seen, todo = set(), [exc]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno is not None:
            return item
        if isinstance(item, BaseException):
            # (gathered from the ranks, the writer's error came pickled: its cause lost, its text kept)
            named = _ERRNO_TEXT.search(str(item))
            if named:
                return OSError(int(named.group(1)), named.group(2))
            todo += [item.__cause__, item.__context__, *item.args, getattr(item, "failures", None)]
        elif isinstance(item, (tuple, list)):
            todo += item
        elif isinstance(item, dict):
            todo += item.values()
    return None



def storage_cause(exc: BaseException, folder: Path) -> str:
    """Why a write under ``folder`` failed, in the operating system's words when it has some: the
    errno text of an OSError behind ``exc``; else (torch's writer reports a full disk as a failed
    position check, without errno) that of a 1 MiB probe written and synced there; else ``exc``'s
    first line."""
    found = _os_error(exc)
    if found is not None:
        return f"{found.strerror} (errno {errno.errorcode.get(found.errno, found.errno)})"
    probe = folder / f".write_probe_{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe_error:
        return f"{probe_error.strerror} (errno {errno.errorcode.get(probe_error.errno, probe_error.errno)})"
    finally:
        probe.unlink(missing_ok=True)
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__



def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"



def free_bytes(folder: Path) -> Optional[int]:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None



def checkpoint_folder(cfg) -> Path:
    """Where a run's checkpoints go: ``checkpoint.dir``, else ``<run_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir or Path(cfg.trainer.run_dir) / "checkpoints")



def resume_candidates(spec: str, default_dir: str | Path) -> tuple[list[Path], bool]:
    """``checkpoint.resume`` as the checkpoints to try, newest first, and whether it named one
    checkpoint (then only that one may be used). ``auto``: every complete checkpoint under
    ``default_dir`` (none: an empty list); a folder of checkpoints: its complete ones. Raises when an
    explicit path has none."""
    if spec == "auto":
        return complete_checkpoints(default_dir)[::-1], False
    path = Path(spec)
    if (path / MARKER).is_file():
        return [path], True
    found = complete_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"checkpoint.resume {spec}: no complete checkpoint there "
                                f"(expected {MARKER} in it or in an iter_* folder under it)")
    return found[::-1], False



def find_checkpoint(spec: str, default_dir: str | Path) -> Optional[Path]:
    """Resolve ``checkpoint.resume`` without reading the shards: the newest complete checkpoint whose
    files have the sizes its marker records (``auto`` under ``default_dir``: None when there is none;
    else a checkpoint folder, or the newest under a folder of checkpoints). Raises when an explicit path
    has none. Resuming also compares digests (:func:`choose_resume_checkpoint`)."""
    candidates, explicit = resume_candidates(spec, default_dir)
    if explicit:
        return candidates[0]
    return next((p for p in candidates if verify(p, full=False) is None), None)



def newest_verified(candidates: list[Path], explicit: bool, verify_one: Callable[[Path], Optional[str]],
                    log: Callable[[str], None], what: str, skipped: str) -> Optional[Path]:
    """The first of ``candidates`` (newest first, :func:`resume_candidates`) for which ``verify_one`` finds no
    problem; each one skipped is logged (``skipped``: the line's prefix). ``explicit`` (one checkpoint
    named) or none verifying raises :class:`ValueError` with one line (``what``: the setting or argument
    that named them). None when there is no candidate."""
    for path in candidates:
        problem = verify_one(path)
        if problem is None:
            return path
        if explicit:
            raise ValueError(f"{what} {path} does not verify: {problem}; name another checkpoint, or its folder "
                             f"for the newest one that verifies")
        log(f"{skipped} checkpoint {path.name} skipped: it does not verify: {problem}")
    if candidates:
        raise ValueError(f"none of the {len(candidates)} complete checkpoint(s) under {candidates[0].parent} "
                         f"verifies (the skipped lines above say why)")
    return None


def read_marker(path: str | Path) -> dict:
    return json.loads((Path(path) / MARKER).read_text())
