"""The package's layers, read from the source: who may import whom, no import cycles, a small package root.

A folder imports only from the layers below it (``LAYERS``, lowest first; folders of one layer do not
import each other). Every import statement counts: at the top, inside a function, under
``TYPE_CHECKING``. docs/architecture.md draws the same layers and says where a new piece goes."""
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sparse_rl_mega", "sglang_patches")

LAYERS = (
    ("sparse_rl_mega.batch", "sparse_rl_mega.runtime"),  # the batch contract; folders, locks, failures, forks
    ("sparse_rl_mega.kv",),  # eviction policies, their registry, the engine's KV settings
    ("sparse_rl_mega.config",),  # the run's typed tree, loading and checks
    ("sparse_rl_mega.algo", "sparse_rl_mega.data", "sparse_rl_mega.reward"),  # pure computations, inputs, rewards
    ("sparse_rl_mega.learner", "sparse_rl_mega.models"),  # Megatron-Core; the tiny model built locally
    ("sparse_rl_mega.rollout",),  # SGLang engines, weight pushes, overlapped rollouts; the SGLang boundary
    ("sparse_rl_mega.train", "sglang_patches"),  # the loop; the plugin inside SGLang's processes
    ("sparse_rl_mega.cli",),  # the programs tools/ runs (launch, evaluate, export, data), their pre-flight,
    # planner and launches
    ("sparse_rl_mega.studies",),  # programs over several launches (ablations, chaos trials), their statistics,
    # run readers and figures
)
MAX_LINES = 500
LONGER_ALLOWED = {"sparse_rl_mega.rollout.sglang_internals"}  # the SGLang boundary: every private access in one place
# imports inside functions: the rare lazy ones; the programs in cli/ and studies/ import torch, SGLang and
# Megatron only in the phase that runs them (their --help, pre-flight and --dry-run load none of them)
MAX_FUNCTION_LOCAL = 26
PACKAGE_ROOT = {"__init__", "batch"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def folder(module: str) -> str:
    """The layer folder a module belongs to: ``sparse_rl_mega.X`` (a sub-package or the root's batch) or
    the plugin package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "sparse_rl_mega" and len(parts) > 1 else parts[0]


def imports(found: dict[str, Path]) -> list[tuple[str, str, int, bool]]:
    """``(importer, imported module, line, inside a function)`` for every import of the project's own
    modules, with ``from package import module`` resolved to the module."""
    out = []
    for name, path in found.items():
        tree = ast.parse(path.read_text())
        in_function = {id(node) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for node in ast.walk(f) if node is not f}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in found else node.module
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] in PACKAGES and target != name:
                    while target not in found:
                        target = target.rsplit(".", 1)[0]
                    out.append((name, target, node.lineno, id(node) in in_function))
    return out


def layer_of(module: str) -> int:
    for level, folders in enumerate(LAYERS):
        if any(module == f or module.startswith(f + ".") for f in folders):
            return level
    raise AssertionError(f"{module}: in no layer of tests/test_layers.py LAYERS (add its folder there and to "
                         "docs/architecture.md)")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_each_layer_imports_only_from_the_layers_below():
    found = modules()
    upward = []
    for importer, target, line, _ in imports(found):
        if folder(importer) == folder(target):
            continue
        if layer_of(target) >= layer_of(importer):
            upward.append(f"{found[importer].relative_to(ROOT)}:{line} imports {target} "
                          f"(layer {layer_of(importer)} -> layer {layer_of(target)})")
    assert upward == []


def test_no_import_cycle_between_modules_folders_or_packages():
    edges = {"module": defaultdict(set), "folder": defaultdict(set), "package": defaultdict(set)}
    for importer, target, _, _ in imports(modules()):
        edges["module"][importer].add(target)
        if folder(importer) != folder(target):
            edges["folder"][folder(importer)].add(folder(target))
        if importer.split(".")[0] != target.split(".")[0]:
            edges["package"][importer.split(".")[0]].add(target.split(".")[0])
    assert {kind: cycles(graph) for kind, graph in edges.items()} == {"module": [], "folder": [], "package": []}


def test_a_small_root_short_modules_and_imports_at_the_top():
    found = modules()
    root = {path.stem for path in found.values() if path.parent == ROOT / "sparse_rl_mega"}
    assert root <= PACKAGE_ROOT, f"modules at the package root beside its contract: {sorted(root - PACKAGE_ROOT)}"
    long = {name: n for name, path in found.items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES and name not in LONGER_ALLOWED}
    assert long == {}, f"modules over {MAX_LINES} lines: split them by job"
    local = [f"{found[importer].relative_to(ROOT)}:{line}" for importer, _, line, inside in imports(found) if inside]
    for path in found.values():  # indirections count as imports inside functions
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "__import__"):
                local.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(local) <= MAX_FUNCTION_LOCAL, local
