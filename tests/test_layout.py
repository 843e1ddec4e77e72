"""The code's layout holds. Imports go down only (cli -> api -> search -> {passes, runtime, export} ->
{model_folder, windows} -> {formats, errors, paths}), with no cycle, also through imports made inside functions; and
torch stays inside layerdrop.export."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import layerdrop

ROOT = Path(layerdrop.__file__).parent
LEVELS = {
    "layerdrop.errors": 0, "layerdrop.formats": 0, "layerdrop.paths": 0,
    "layerdrop": 1, "layerdrop._lm_eval_hook": 1, "layerdrop.model_folder": 1, "layerdrop.windows": 1,
    "layerdrop.checkpoints": 1, "layerdrop.task_data": 1, "layerdrop.memory": 1,
    "layerdrop.export": 2, "layerdrop.passes": 2, "layerdrop.runtime": 2,
    "layerdrop.search": 3,
    "layerdrop.api": 4,
    "layerdrop.cli": 5,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (ROOT.parent / relative).with_suffix(".py").is_file() or (ROOT.parent / relative / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Every layerdrop module `path` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("layerdrop")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("layerdrop"):
            for alias in node.names:  # `from layerdrop import api` names a module; `from x import f` does not
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _is_module(candidate) else node.module)
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return module if module in LEVELS else ".".join(parts[:2]) if ".".join(parts[:2]) in LEVELS else parts[0]


def _graph() -> dict[str, set[str]]:
    return {_module_name(path): _imports(path) for path in sorted(ROOT.rglob("*.py"))}


def test_every_module_has_a_level():
    assert {_part(module) for module in _graph()} <= set(LEVELS)


def test_imports_go_down_only():
    upward = []
    for module, imported in _graph().items():
        for target in imported:
            source_part, target_part = _part(module), _part(target)
            if source_part != target_part and LEVELS[target_part] >= LEVELS[source_part]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not go down:\n" + "\n".join(sorted(upward))


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                cycles.append(" -> ".join([*trail[trail.index(target):], target]) if target in trail else target)
            elif target not in state:
                visit(target, [*trail, target])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_torch_and_transformers_only_in_export():
    leaks = []
    for path in ROOT.rglob("*.py"):
        if "export" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            leaks += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ("torch", "transformers")]
    assert not leaks, leaks


BENCHMARKS = ROOT.parent / "benchmarks"


def _private_names(path: Path) -> list[str]:
    """Private names of the package that a file under benchmarks/ reaches: `from layerdrop.x import _y`, a module
    path with a part that starts with `_`, or `layerdrop.x._y` written out anywhere in the text."""
    def private(dotted: str) -> bool:  # dunders such as __version__ are public
        return any(p.startswith("_") and not p.endswith("__") for p in dotted.split("."))

    text = path.read_text(encoding="utf-8")
    found = [name for name in re.findall(r"\blayerdrop(?:\.\w+)+", text) if private(name)]
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "layerdrop":
                found += [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
                found += [node.module] if private(node.module) else []
            elif isinstance(node, ast.Import):
                found += [a.name for a in node.names if a.name.split(".")[0] == "layerdrop" and private(a.name)]
    return found


def test_benchmarks_use_only_public_names_of_the_package(tmp_path):
    assert (BENCHMARKS / "reproduce.py").is_file()
    reached = {p.name: _private_names(p) for p in sorted(BENCHMARKS.iterdir()) if p.suffix in (".py", ".sh")}
    assert not {name: names for name, names in reached.items() if names}
    # the check itself finds each form
    probe = tmp_path / "probe.py"
    probe.write_text("from layerdrop.api.plan import plan, _prefix\nimport layerdrop._lm_eval_hook\n"
                     "from layerdrop.runtime import bench\nx = layerdrop.api.plan._HeldOut\n")
    assert sorted(_private_names(probe)) == ["layerdrop._lm_eval_hook", "layerdrop._lm_eval_hook",
                                             "layerdrop.api.plan._HeldOut", "layerdrop.api.plan._prefix"]


def test_benchmarks_hold_at_most_ten_files():
    assert len([p for p in BENCHMARKS.iterdir() if p.name != "__pycache__"]) <= 10
