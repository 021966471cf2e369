"""The package's imports run one way (architecture: compression -> comm -> policy -> megatron -> training,
tools on top), with no cycle between modules, and comm/'s rooms in the order a reader follows a call.

Read from the source with ``ast`` (nothing is imported): module-level *and* function-level imports
count, since a function-level import is a cycle put off until the first call, not a cycle broken."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_zpp"

# Each layer may import the layers before it, never one after it.
LAYERS = ["compression", "comm", "policy", "megatron", "training"]
# Beside the layers: what each may import (perfmodel is pure math: nothing distributed).
SIDE = {"perfmodel": {"compression", "policy"}, "advise": {"perfmodel", "compression", "policy"}, "testing": set()}
# Side areas a layer may use: training's --zpp-policy auto ranks policies with the model (pure math, which
# imports nothing of training's, so no cycle).
USES_SIDE = {"training": {"perfmodel"}}
# comm/ top-down (comm/README.md): groups and transport, buffers, accounting, codec stages, then the
# collectives that compose them. A module imports only rooms before it.
COMM_ROOMS = ["execution", "scratch", "topology", "stats", "wire", "error_feedback", "any_codec", "passthrough",
              "reduce_scatter", "all_gather", "all_reduce", "all_to_all", "p2p", "__init__"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (module or function level)."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            # `from pkg import submodule` depends on the submodule (the package's __init__ runs first, as a
            # parent package always does, which is no dependency); `from pkg import name`, on pkg/__init__
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module)
    resolved = set()
    for module in found:
        if module.split(".")[0] != "megatron_zpp":
            continue
        while module not in MODULES and "." in module:  # a name inside a module, or the compiled _C
            module = module.rsplit(".", 1)[0]
        if module != name and module != "megatron_zpp":  # the root package holds only __version__
            resolved.add(module)
    return resolved


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _area(module: str) -> str:
    return module.split(".")[1]


def test_the_walker_sees_function_level_imports():
    # training/data.py imports the tokenizer inside functions only: the walker must see it.
    assert "megatron_zpp.training.tokenizer" in GRAPH["megatron_zpp.training.data"]
    # `from megatron_zpp.comm import any_codec` is the submodule, not the package's __init__
    assert "megatron_zpp.comm.any_codec" in GRAPH["megatron_zpp.comm.all_gather"]
    assert "megatron_zpp.comm" not in GRAPH["megatron_zpp.comm.all_gather"]
    # `from megatron_zpp.comm import Topology` is the package's __init__
    assert "megatron_zpp.comm" in GRAPH["megatron_zpp.megatron.hooks"]


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles (module and function level):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_layers_import_downward_only():
    areas = {_area(m) for m in MODULES if m != "megatron_zpp"}
    assert areas <= set(LAYERS) | set(SIDE), f"unplaced areas (add them to LAYERS or SIDE): {areas - set(LAYERS) - set(SIDE)}"
    bad = []
    for module, deps in GRAPH.items():
        if module == "megatron_zpp":
            continue
        area = _area(module)
        allowed = SIDE[area] if area in SIDE else set(LAYERS[:LAYERS.index(area)]) | USES_SIDE.get(area, set())
        bad += [f"{module} -> {dep}" for dep in sorted(deps) if _area(dep) != area and _area(dep) not in allowed]
    assert not bad, "imports against the layer order " + " -> ".join(LAYERS) + ":\n" + "\n".join(bad)


def test_the_package_never_imports_tools():
    bad = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{module} -> {n}" for n in names if n.split(".")[0] in ("tools", "pretrain_gpt")]
    assert not bad, bad


def test_comm_rooms_read_top_down():
    comm = {m.split(".")[-1] if m != "megatron_zpp.comm" else "__init__": m
            for m in MODULES if m == "megatron_zpp.comm" or m.startswith("megatron_zpp.comm.")}
    assert set(comm) == set(COMM_ROOMS), f"comm modules not placed in COMM_ROOMS: {set(comm) ^ set(COMM_ROOMS)}"
    bad = []
    for room, module in comm.items():
        for dep in GRAPH[module]:
            if dep in comm.values():
                dep_room = next(r for r, m in comm.items() if m == dep)
                if COMM_ROOMS.index(dep_room) >= COMM_ROOMS.index(room):
                    bad.append(f"{room} -> {dep_room}")
    assert not bad, "comm/ imports a later room: " + ", ".join(sorted(bad))
