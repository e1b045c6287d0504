"""The import graph, drawn from the code with ``ast``: layers only point down, no cycles, and the
installed distribution puts no generic top-level name (``service``, ``dashboards``) on sys.path."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Source folder -> the import name it is installed under (pyproject's package-dir).
PACKAGES = {"trainguard": "trainguard", "service": "trainguard.service", "dashboards": "trainguard.dashboards",
            "trainer_agent": "trainer_agent"}
#: Import prefix -> layer. A module may import its own layer or lower ones, never a higher one.
LAYERS = [
    ("trainguard", 0),  # the root package: a docstring and the version
    ("trainguard.protocol", 0),
    ("trainer_agent", 1),
    ("trainguard.service", 1),
    ("trainguard.dashboards", 2),
    ("trainguard.demo", 3),
    ("trainguard.cli", 3),
]
#: Inside the agent: subpackage (or top-level module) -> layer, by the same rule (a module imports
#: its own layer or lower ones, at import time or inside a function). The configuration and the
#: library adapters at the bottom; what measures a step, the data pipeline, the report step, what
#: acts on training, the on-demand checks; the facade (``agent``, the package itself and its
#: documented re-exports) and the framework callbacks on top.
AGENT_LAYERS = [
    ("trainer_agent.version", 0), ("trainer_agent.config", 0), ("trainer_agent.compat", 0),
    ("trainer_agent.measure", 1),
    ("trainer_agent.data", 2),
    ("trainer_agent.report", 3),
    ("trainer_agent.control", 4),
    ("trainer_agent.diagnostics", 5),
    ("trainer_agent", 6),  # the package itself, agent.py, the documented re-exports (dataset.py)
    ("trainer_agent.integrations", 7),
]

#: Third-party packages a layer must not import (the controller's image has no torch; the
#: protocol is shared by every side).
FORBIDDEN = {
    "trainguard.protocol": {"torch", "fastapi", "starlette", "uvicorn", "numpy"},
    "trainguard.service": {"torch", "trainer_agent"},
    "trainguard.dashboards": {"torch", "trainer_agent", "fastapi"},
    "trainer_agent": {"fastapi", "starlette", "uvicorn", "trainguard.service", "trainguard.dashboards",
                      "trainguard.demo", "trainguard.cli", "transformers", "lightning", "accelerate"},
}

#: The one module each framework may be imported from (the opt-in callbacks; extras hf, lightning).
FRAMEWORK_MODULES = {
    "trainer_agent.integrations.hf": {"transformers", "accelerate"},
    "trainer_agent.integrations.lightning": {"lightning"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mod = ".".join([name, *parts])
            if folder == "trainguard" and parts and parts[0] in ("service", "dashboards"):
                continue
            out[mod] = path
    return out


def _imports(mod: str, path: Path, *, top_level_only: bool) -> set[str]:
    """Absolute names imported by a module; with ``top_level_only``, only imports executed at import
    time (module body, not function bodies or ``TYPE_CHECKING`` blocks)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    names: set[str] = set()

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            func = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                func = True
            if isinstance(child, ast.Import) and not (top_level_only and func):
                names.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and not (top_level_only and func):
                if child.level:
                    base = mod.split(".")
                    base = base[: len(base) - child.level + (1 if is_pkg else 0)]
                    prefix = ".".join(base + ([child.module] if child.module else []))
                else:
                    prefix = child.module or ""
                names.add(prefix)
                names.update(f"{prefix}.{a.name}" for a in child.names)
            visit(child, func)

    visit(tree, False)
    return names


def _layer(name: str, layers: list[tuple[str, int]] = LAYERS) -> int | None:
    best = None
    for prefix, layer in layers:
        if name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    return None if best is None else best[1]


MODULES = _modules()


def test_every_source_module_is_mapped():
    assert "trainguard.protocol.wire" in MODULES and "trainguard.service.app" in MODULES
    assert "trainer_agent.agent" in MODULES and "trainguard.dashboards.build" in MODULES


def test_no_import_points_up_a_layer():
    upward = []
    for mod, path in MODULES.items():
        own = _layer(mod)
        assert own is not None, f"{mod} belongs to no layer"
        for name in _imports(mod, path, top_level_only=False):
            other = _layer(name)
            if other is not None and other > own:
                upward.append(f"{mod} -> {name}")
    assert not upward, "imports from a lower layer up:\n" + "\n".join(sorted(upward))


def _agent_upward(modules: dict[str, Path]) -> list[str]:
    upward = []
    for mod, path in modules.items():
        if not mod.startswith("trainer_agent"):
            continue
        own = _layer(mod, AGENT_LAYERS)
        assert own is not None, f"{mod} belongs to no layer of the agent"
        for name in _imports(mod, path, top_level_only=False):
            other = _layer(name, AGENT_LAYERS) if name.startswith("trainer_agent") else None
            if other is not None and other > own:
                upward.append(f"{mod} -> {name}")
    return upward


def test_the_agents_subpackages_import_only_their_own_layer_or_lower_ones():
    upward = _agent_upward(MODULES)
    assert not upward, "imports from a lower layer of the agent up:\n" + "\n".join(sorted(upward))


def test_an_upward_import_inside_the_agent_is_found(tmp_path):
    """The check above sees an import inside a function, from a lower subpackage up to a higher one."""
    bad = tmp_path / "stats.py"
    bad.write_text("def f():\n    from trainer_agent.control.plane import ControlPlane\n    return ControlPlane\n")
    assert sorted(_agent_upward({"trainer_agent.measure.stats": bad})) == [
        "trainer_agent.measure.stats -> trainer_agent.control.plane",
        "trainer_agent.measure.stats -> trainer_agent.control.plane.ControlPlane"]


def test_no_sibling_product_packages_import_each_other():
    crossing = [f"{mod} -> {name}" for mod, path in MODULES.items()
                for name in _imports(mod, path, top_level_only=False)
                if (mod.startswith("trainer_agent") and name.startswith("trainguard.service"))
                or (mod.startswith("trainguard.service") and name.startswith("trainer_agent"))]
    assert not crossing, crossing


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_forbidden_third_party_imports(package):
    bad = []
    for mod, path in MODULES.items():
        if mod == package or mod.startswith(package + "."):
            forbidden = FORBIDDEN[package] - FRAMEWORK_MODULES.get(mod, set())
            for name in _imports(mod, path, top_level_only=False):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    bad.append(f"{mod} -> {name}")
    assert not bad, bad


def test_no_import_cycles_between_modules():
    """Cycles among module-level imports (what runs at import time): none."""
    graph = {}
    for mod, path in MODULES.items():
        targets = set()
        for name in _imports(mod, path, top_level_only=True):
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):
                targets.add(name)
        graph[mod] = targets
    state: dict[str, int] = {}
    cycles = []

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                dfs(nxt, stack + [nxt])
        state[node] = 2

    for mod in sorted(graph):
        if mod not in state:
            dfs(mod, [mod])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_installed_names_are_not_generic():
    """Outside the repository (no checkout on sys.path), only ``trainguard`` and ``trainer_agent``
    import; ``service`` and ``dashboards`` are not installed as top-level names."""
    code = ("import importlib.util, sys\n"
            "sys.path = [p for p in sys.path if p not in ('', '.', %r)]\n"
            "import trainguard.service.app, trainguard.dashboards.build, trainguard.protocol.wire, trainer_agent\n"
            "print([n for n in ('service', 'dashboards') if importlib.util.find_spec(n) is not None])\n") % str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_protocol_imports_without_torch_or_fastapi():
    code = ("import sys\n"
            "import trainguard.protocol.wire, trainguard.protocol.catalog\n"
            "print(sorted(m for m in ('torch', 'fastapi', 'starlette') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_only_the_framework_callbacks_import_their_framework_modules():
    """Nothing but the user imports ``trainer_agent.integrations.hf``/``.lightning``: importing the
    agent never pulls a framework in."""
    bad = [f"{mod} -> {name}" for mod, path in MODULES.items() if mod not in FRAMEWORK_MODULES
           for name in _imports(mod, path, top_level_only=False)
           if any(name == f or name.startswith(f + ".") for f in FRAMEWORK_MODULES)]
    assert not bad, bad


def test_importing_the_agent_imports_no_training_framework():
    agent_modules = sorted(m for m in MODULES if m.startswith("trainer_agent") and m not in FRAMEWORK_MODULES)
    code = ("import sys\n"
            f"for m in {agent_modules!r}: __import__(m)\n"
            "import trainer_agent as ta; ta.attach, ta.AgentConfig, ta.DataMonitor\n"
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'pytorch_lightning', 'lightning_fabric')"
            " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
