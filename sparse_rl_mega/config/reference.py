"""The configuration reference (``docs/config-reference.md``), generated from the config dataclasses:
every key of :class:`~sparse_rl_mega.config.run.RunConfig` with its type, default and the comment that
documents it in the source (the comment lines right above the field, then the one after it on its
line), each section under its class docstring.

``python -m sparse_rl_mega.config.reference`` writes the page; ``tests/test_config.py`` checks that the
committed page is this module's output, so a key added without regenerating it fails the suite.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from typing import Any
from sparse_rl_mega.runtime.paths import ROOT

PAGE = ROOT / "docs" / "config-reference.md"
HEADER = """# Configuration reference

Generated from the config dataclasses (`sparse_rl_mega/config/`) by `python -m
sparse_rl_mega.config.reference`; do not edit by hand. Every key of a run's YAML (`--set KEY=VALUE` on
the command line), its type, its default and what it does. How the sections fit together:
[configuration.md](configuration.md).
"""


def field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` from ``cls``'s source: the comment lines right above a field, then the
    comment on its own line (without the ``#``), joined by spaces."""
    source = inspect.getsource(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    comments_by_line: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments_by_line[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    found: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        name = stripped.split(":", 1)[0].strip()
        if name not in names or name in found or not line.startswith("    ") or line.startswith("     "):
            continue
        above: list[str] = []
        previous = number - 1
        while previous >= 1 and lines[previous - 1].strip().startswith("#"):
            above.insert(0, comments_by_line.get(previous, ""))
            previous -= 1
        found[name] = " ".join(filter(None, [*above, comments_by_line.get(number, "")]))
    return found


def _type_name(hint: Any) -> str:
    text = str(hint).replace("typing.", "").replace("NoneType", "None")
    return text[len("<class '"):-2] if text.startswith("<class '") else text


def _default(f: dataclasses.Field) -> str:  # type: ignore[type-arg]
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "(section)" if dataclasses.is_dataclass(value) else repr(value)
    return "(required)"


def sections(cls: type, prefix: str = "") -> list[tuple[str, type, list[tuple[str, str, str, str]]]]:
    """``(section key, class, [(key, type, default, comment)])`` for ``cls`` and every section below it,
    depth first; a field whose type is a config dataclass is a section."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows, below = [], []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)] or [hint]
        if dataclasses.is_dataclass(inner[0]) and isinstance(inner[0], type):
            below += sections(inner[0], key + ".")
            rows.append((key, inner[0].__name__, _default(f), comments.get(f.name, "") or "a section: below"))
        else:
            rows.append((key, _type_name(hint), _default(f), comments.get(f.name, "")))
    return [(prefix.rstrip("."), cls, rows), *below]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    from sparse_rl_mega.config.run import RunConfig

    out = [HEADER]
    for key, cls, rows in sections(RunConfig):
        out.append(f"\n## `{key or 'run'}` ({cls.__name__})\n")
        doc = inspect.cleandoc(cls.__doc__ or "")
        if doc and not doc.startswith(f"{cls.__name__}("):  # (not the dataclass's generated signature)
            out.append(" ".join(doc.split()) + "\n")
        out.append("\n| key | type | default | what it does |\n|---|---|---|---|\n")
        out += [f"| `{k}` | `{_cell(t)}` | `{_cell(d)}` | {_cell(c)} |\n" for k, t, d, c in rows]
    return "".join(out)


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE}", file=sys.stderr)
