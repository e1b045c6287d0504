"""Private members of libraries are used only in their adapter modules (``trainer_agent/compat/``),
each listed there with the test that fails when it changes and the versions it was checked against.

Read from the code with ``ast``: outside the adapters, no module imports a library's private module
or name (``torch.utils._pytree``, ``from grafanalib._gen import ...``) and no attribute access (or
``getattr``/``hasattr``/``setattr`` with a literal name) reaches a private name that is not ours: one
that no module of ours defines (a function, class, argument, variable or ``self.``/``cls.``
attribute) or one that an adapter declares as a library's (``_scale``, ``_timeout``, ... on anything
but ``self``/``cls``)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("trainer_agent", "service", "trainguard", "dashboards")
OUR_PACKAGES = {"trainer_agent", "trainguard", "service", "dashboards", "tests"}
#: Adapter module (path) -> its import name; one per library.
ADAPTERS = {
    "trainer_agent/compat/torch_private.py": "trainer_agent.compat.torch_private",
    "trainer_agent/compat/torch_hooks.py": "trainer_agent.compat.torch_hooks",
    "trainer_agent/compat/torch_ddp.py": "trainer_agent.compat.torch_ddp",
    "trainer_agent/compat/torch_dynamo.py": "trainer_agent.compat.torch_dynamo",
    "trainer_agent/compat/httpx_private.py": "trainer_agent.compat.httpx_private",
}
#: Underscore names that are documented public API: namedtuple's methods and fields (their
#: underscore only avoids clashing with field names) and ``os._exit``.
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_field_defaults", "_make", "_exit"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
            for folder in SOURCE_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


SOURCES = _sources()


def _defined_names(trees: dict[str, ast.Module]) -> set[str]:
    """Every name our code defines (or binds on ``self``/``cls``)."""
    names = {Path(path).stem for path in trees}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
    return names


def _adapter_members() -> dict[str, tuple]:
    return {path: importlib.import_module(mod).PRIVATE_MEMBERS for path, mod in ADAPTERS.items()}


MEMBERS = _adapter_members()
#: The private names the adapters declare as a library's.
LIBRARY_NAMES = {m.name for members in MEMBERS.values() for m in members}
OURS = _defined_names({p: t for p, t in SOURCES.items() if p not in ADAPTERS})


def _private_uses(tree: ast.Module, ours: set[str]) -> list[tuple[int, str, str]]:
    """(line, what, the private name) for every use of a library's private member in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                private = [p for p in parts if _private(p)]
                if parts[0] not in OUR_PACKAGES and private:
                    out.append((node.lineno, f"import {alias.name}", private[0]))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] in OUR_PACKAGES or parts[0] == "__future__":
                continue
            names = [a.name for a in node.names]
            private = [p for p in parts + names if _private(p)]
            if private:
                out.append((node.lineno, f"from {node.module} import {', '.join(names)}", private[0]))
        else:
            if isinstance(node, ast.Attribute):
                name, base = node.attr, node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                name, base = node.args[1].value, node.args[0]
            else:
                continue
            if not _private(name) or name in PUBLIC_UNDERSCORE:
                continue
            on_self = isinstance(base, ast.Name) and base.id in ("self", "cls")
            if name not in ours or (name in LIBRARY_NAMES and not on_self):
                out.append((node.lineno, ast.unparse(node), name))
    return out


def test_no_private_member_of_a_library_outside_its_adapter():
    found = [f"{path}:{line}: {what}" for path, tree in SOURCES.items() if path not in ADAPTERS
             for line, what, _ in _private_uses(tree, OURS)]
    assert not found, ("a library's private member outside trainer_agent/compat/ (add a function to the "
                       "library's adapter, with a test, and call it):\n" + "\n".join(found))


def test_the_scan_finds_each_kind_of_private_use():
    code = ("import torch.utils._pytree\n"
            "from httpcore._backends.sync import SyncBackend\n"
            "from grafanalib import _gen\n"
            "x = scaler._scale\n"
            "y = getattr(engine, '_queue_thing', None)\n"
            "z = torch._foreach_norm(ts)\n"
            "self._scale = 1\n"  # our own attribute on self: allowed
            "w = parts._replace(netloc='h')\n"  # namedtuple's public API: allowed
            "v = probes._ids_of(batch)\n")  # a private name our code defines: allowed
    uses = [what for _, what, _ in _private_uses(ast.parse(code), OURS | {"_ids_of"})]
    assert uses == ["import torch.utils._pytree", "from httpcore._backends.sync import SyncBackend",
                    "from grafanalib import _gen", "scaler._scale", "getattr(engine, '_queue_thing', None)",
                    "torch._foreach_norm"]


@pytest.mark.parametrize("path", sorted(ADAPTERS))
def test_each_adapter_declares_every_private_member_it_uses(path):
    """The table of an adapter is complete (every private name it reaches is declared) and true
    (every declared name is used there, by an adapter function that exists, with a test that
    exists in ``tests/agent/test_<module>.py``)."""
    module = importlib.import_module(ADAPTERS[path])
    tree = SOURCES[path]
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        t.id for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    declared = {m.name for m in module.PRIVATE_MEMBERS}
    used = {name for _, _, name in _private_uses(tree, own)}
    assert used <= declared, f"undeclared private members in {path}: {sorted(used - declared)}"
    text = (ROOT / path).read_text()
    test_path = ROOT / "tests" / "agent" / f"test_{Path(path).stem}.py"
    tests = {n.name for n in ast.walk(ast.parse(test_path.read_text())) if isinstance(n, ast.FunctionDef)}
    for member in module.PRIVATE_MEMBERS:
        assert member.name in text or member.name.startswith("_foreach_"), member
        assert hasattr(module, member.adapter), member
        assert member.test in tests, f"{member.path}: no {member.test} in {test_path.relative_to(ROOT)}"
        assert member.path.rsplit(".", 1)[-1] == member.name or member.name in member.path.split("."), member


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


@pytest.mark.parametrize("path", sorted(ADAPTERS))
def test_the_pinned_versions_are_the_checked_ones(path):
    """Moving a pin past the release an adapter's members were checked against fails here until
    the adapter's tests are run on the new release and ``CHECKED_VERSIONS`` says so."""
    checked = importlib.import_module(ADAPTERS[path]).CHECKED_VERSIONS
    pins = _pins()
    assert {lib: pins.get(lib) for lib in checked} == checked


def test_adapters_import_no_other_agent_module():
    """The adapters are the bottom of the agent: any module of it may call them."""
    for path in [*ADAPTERS, "trainer_agent/compat/__init__.py"]:
        tree = ast.parse((ROOT / path).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        ours = {m for m in imported if m.split(".")[0] in OUR_PACKAGES}
        assert ours <= {"trainer_agent.compat"}, (path, ours)
