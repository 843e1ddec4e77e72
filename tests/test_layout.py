"""Issue 15: the code's layout holds. Imports go down only (cli -> api -> search -> {passes, runtime, export} ->
{model_folder, windows} -> {formats, errors}), with no cycle, also through imports made inside functions; and
torch stays inside layerdrop.export."""

from __future__ import annotations

import ast
from pathlib import Path

import layerdrop

ROOT = Path(layerdrop.__file__).parent
LEVELS = {
    "layerdrop.errors": 0, "layerdrop.formats": 0,
    "layerdrop": 1, "layerdrop._lm_eval_hook": 1, "layerdrop.model_folder": 1, "layerdrop.windows": 1,
    "layerdrop.task_data": 1,
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
