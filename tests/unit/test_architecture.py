"""The tree is the architecture: layers that import only downwards, no import circles, modules of at most 500 lines.

The import graph is read from the source (every ``import`` and ``from ... import``, those inside functions too), so a
deferred import cannot hide a circle. docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("hetero_cs", "calibration")

# Lowest first: a module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("base", ("hetero_cs.errors", "hetero_cs._copying", "hetero_cs._supported")),
    ("planning", ("hetero_cs.planning",)),
    ("devices", ("hetero_cs.devices",)),
    ("engine.step", ("hetero_cs.engine.step",)),
    ("engine._compat", ("hetero_cs.engine._compat",)),
    ("calibration", ("calibration",)),
    ("engine.faults", ("hetero_cs.engine.faults",)),
    ("engine.memory", ("hetero_cs.engine.memory",)),
    ("engine", ("hetero_cs.engine",)),
    ("engine.multi_worker", ("hetero_cs.engine.multi_worker",)),
    ("front ends", ("hetero_cs", "hetero_cs.cli", "hetero_cs.launch", "hetero_cs.launch_config",
                    "hetero_cs.supervisor", "hetero_cs.emulation", "calibration.__main__")),
)
MAX_LINES = 500


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(path: pathlib.Path, modules, *, top_level_only: bool) -> dict[str, int]:
    """The modules ``path`` names in its imports (those inside functions too, unless ``top_level_only``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else ast.walk(tree)
    targets: dict[str, int] = {}
    for node in nodes:
        found = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        elif isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        for target in found:
            if target in modules:
                targets.setdefault(target, node.lineno)
    return targets


def _graph(*, runtime: bool = False) -> dict[str, dict[str, int]]:
    """Module -> {module it imports: line}.

    ``runtime``: as Python runs the imports: importing ``a.b.c`` from outside package ``a.b`` also runs ``a.b``'s
    ``__init__``, and a package's ``__init__`` counts with what it imports when it is imported (a name it imports
    only when asked for, through a module ``__getattr__``, is not imported then).
    """
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets = _imports(path, modules, top_level_only=runtime and is_package)
        if runtime:
            for target, line in list(targets.items()):
                parts = target.split(".")
                for depth in range(1, len(parts)):
                    parent = ".".join(parts[:depth])
                    if parent in modules and parent != name and not name.startswith(parent + "."):
                        targets.setdefault(parent, line)
        targets.pop(name, None)
        graph[name] = targets
    return graph


def _layer(module: str) -> int:
    best = (-1, -1)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[1]:
                best = (index, len(prefix))
    if module in LAYERS[-1][1]:
        return len(LAYERS) - 1
    assert best[0] >= 0, f"{module} is in no layer of LAYERS"
    return best[0]


def _circles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize("runtime", [False, True], ids=["as written", "as run"])
def test_no_import_circles(runtime):
    graph = _graph(runtime=runtime)
    circles = _circles(graph)
    described = [[f"{a} -> {b} (line {line})" for a in circle for b, line in graph[a].items() if b in circle]
                 for circle in circles]
    assert not circles, described


def test_every_layer_imports_only_downwards():
    upward = [f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]}), line {line}"
              for a, targets in sorted(_graph().items()) for b, line in targets.items() if _layer(b) > _layer(a)]
    assert not upward, upward


def test_the_devices_layer_never_imports_the_engine():
    """Stated on its own because docs/architecture.md states it so: planning -> devices -> engine -> front ends."""
    offenders = [f"{a} -> {b}" for a, targets in _graph().items() if a.startswith("hetero_cs.devices")
                 for b in targets if b.startswith(("hetero_cs.engine", "calibration"))]
    assert not offenders, offenders


def test_every_module_has_at_most_500_lines():
    long = {str(path.relative_to(ROOT)): n for path in _modules().values()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, long


@pytest.mark.parametrize("package", ["hetero_cs.engine", "hetero_cs.engine.step", "hetero_cs.engine._compat",
                                     "hetero_cs.engine.faults", "hetero_cs.engine.memory",
                                     "hetero_cs.engine.multi_worker"])
def test_each_engine_package_says_what_it_owns_and_may_import(package):
    path = _modules()[package]
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    assert "may import" in doc, f"{path.relative_to(ROOT)}'s docstring does not say what the package may import"


def test_the_supervisor_and_the_launcher_import_without_tensorflow():
    """``hetero-cs run`` and ``launch`` only watch processes: they must not load TensorFlow or Keras to do it."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["tensorflow"] = None
        sys.modules["keras"] = None
        import hetero_cs.supervisor, hetero_cs.launch, hetero_cs.devices.workload
        from hetero_cs.engine.faults import supervised_run
        print("ok")
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
