"""The package's import graph: no cycles, no borrowed private names, imports pointing down.

Read from the source with `ast` (nothing is imported to build the graph), counting every
import wherever it is written: at module level, under `if TYPE_CHECKING:`, in a `try:`, or
deferred into a function body; `import a.b`, `import a.b as c`, `from a import b`, relative
imports, and `importlib.import_module("...")` / `__import__("...")` with a literal name. The
rules are those of docs/architecture.md ("The import rules"):

1. **No cycles.** Module A depends on module B when A imports B or a name from B. Importing
   `a.b.c` also runs the `__init__` of every package on the way (`a.b`), so A depends on those
   too, except the packages A itself is inside (already initializing when A runs). A cycle
   through a deferred import is a cycle. A module importing itself (`python -m`) is not one.
2. **No private name of another module.** A dotted path component `_x` (one leading
   underscore; dunders are public) belongs to the module or package it is defined in, its
   *owner*. The owner itself may use it, and when the owner is a package, so may the package's
   `__init__` and every module inside that package (a private submodule such as
   `tokencapture.postgres._client` serves its package; `tokencapture._otel` serves
   `tokencapture`). Anyone else may not: not by `from m import _x`, not by `import m._x`, not
   by `m._x` on an imported module. The one exception is `tokencapture._core`, the
   designated native module every layer builds on.
3. **Imports point down.** Every module belongs to a layer (`LAYERS` below); a module imports
   only from its own layer or lower ones. In the backend layer the families are siblings: the
   file backend and the PostgreSQL backend do not import each other, except the declared
   bridges in `CROSS_BACKEND`. A module the table does not place fails the test: place it.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "python" / "tokencapture"
NATIVE = "tokencapture._core"

# Layers, lowest first: (rank, name, module patterns). A pattern ending in ".*" is a package
# and everything in it; the most specific pattern wins.
LAYERS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (0, "native", (NATIVE,)),
    (
        1,
        "contract",
        (
            "tokencapture.records",
            "tokencapture.protocols",
            "tokencapture.fingerprint",
            "tokencapture.staging_records",
            "tokencapture.staging_digest",
            "tokencapture.staging_errors",
            "tokencapture.columnar",
        ),
    ),
    (
        2,
        "core",
        (
            "tokencapture.latency",
            "tokencapture.forking",
            "tokencapture.descriptors",
            "tokencapture.validation",
            "tokencapture.rollout_files",
            "tokencapture.entries",
            "tokencapture.model_building",
            "tokencapture.jobs",
            "tokencapture.resolution",
            "tokencapture.ledger_rows",
            "tokencapture.metrics",
            "tokencapture._otel",
            "tokencapture.operations",
            "tokencapture.staging_attachments",
            "tokencapture.staging_rows",
            "tokencapture.capture_settings",
        ),
    ),
    (
        3,
        "backend:file",
        (
            "tokencapture.store",
            "tokencapture.ledger",
            "tokencapture.lineage",
            "tokencapture.staging.store",
            "tokencapture.transfer",
        ),
    ),
    (3, "backend:postgres", ("tokencapture.postgres", "tokencapture.postgres.*")),
    (
        4,
        "front",
        (
            "tokencapture",
            "tokencapture.__main__",
            "tokencapture.cli",
            "tokencapture.config",
            "tokencapture.conformance",
            "tokencapture.conformance_runner",
            "tokencapture.conformance_staging",
            # The staging package: its __init__ exports the file backend, and its submodules
            # re-export the lower modules above under their public paths.
            "tokencapture.staging",
            "tokencapture.staging.records",
            "tokencapture.staging.digest",
            "tokencapture.staging.errors",
            "tokencapture.staging.attachments",
            "tokencapture.staging.rows",
            "tokencapture.reference",
            "tokencapture.reference.*",
            "tokencapture.gateway",
            "tokencapture.gateway.*",
        ),
    ),
)

# Declared imports between sibling backends: (importer, imported).
CROSS_BACKEND: frozenset[tuple[str, str]] = frozenset(
    {
        # `tokencapture copy` moves rollouts between PostgreSQL and a file store: a bridge
        # between the two backends by purpose (the image and the directory side are the file
        # backend's, `tokencapture.transfer`).
        ("tokencapture.postgres.transfer", "tokencapture.store"),
        ("tokencapture.postgres.transfer", "tokencapture.transfer"),
    }
)


@dataclass(frozen=True)
class Reference:
    """One use of a package module by another: `module` (and `name` in it, if a name)."""

    importer: str
    line: int
    module: str
    name: str | None

    @property
    def path(self) -> str:
        return self.module if self.name is None else f"{self.module}.{self.name}"


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under `root`: dotted name -> source file."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(source: Path) -> bool:
    return source.name == "__init__.py"


def _absolute(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        assert module is not None
        return module
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([module] if module else [])])


def _literal_import(node: ast.Call) -> str | None:
    """The module of `importlib.import_module("m")` or `__import__("m")`, else None."""
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in {"import_module", "__import__"}
    )
    if named and node.args and isinstance(node.args[0], ast.Constant):
        value = node.args[0].value
        return value if isinstance(value, str) else None
    return None


def references(
    importer: str, source: str, is_package: bool, modules: set[str]
) -> Iterator[Reference]:
    """Every reference to a package module (or a name in one) that `source` makes."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # a local name -> the package module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "tokencapture":
                    continue
                yield Reference(importer, node.lineno, alias.name, None)
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(importer, is_package, node.level, node.module)
            if base.split(".")[0] != "tokencapture":
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    yield Reference(importer, node.lineno, submodule, None)
                    bound[alias.asname or alias.name] = submodule
                else:
                    yield Reference(importer, node.lineno, base, alias.name)
        elif isinstance(node, ast.Call):
            name = _literal_import(node)
            if name is not None and name.split(".")[0] == "tokencapture":
                yield Reference(importer, node.lineno, name, None)
    # `m._x` on a name bound to a package module is a use of `_x` as well.
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain: list[str] = []
            inner: ast.expr = node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in bound:
                chain.reverse()
                module = bound[inner.id]
                # Walk down through submodules (`tokencapture.store` after `import tokencapture`).
                while chain and f"{module}.{chain[0]}" in modules:
                    module = f"{module}.{chain.pop(0)}"
                if chain:
                    yield Reference(importer, node.lineno, module, chain[0])


def _private_owner(path: str) -> str | None:
    """The owner of the first private component of a dotted path (None: nothing private)."""
    parts = path.split(".")
    for index in range(1, len(parts)):
        part = parts[index]
        if ".".join(parts[: index + 1]) == NATIVE:
            return None  # the designated native module, and everything in it
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return ".".join(parts[:index])
    return None


def private_violations(refs: list[Reference]) -> list[str]:
    problems: list[str] = []
    for ref in dict.fromkeys(refs):  # `m._x.y` and `m._x` are one use
        owner = _private_owner(ref.path)
        if owner is None or ref.importer == owner or ref.importer.startswith(owner + "."):
            continue
        problem = (
            f"{ref.importer} (line {ref.line}) uses {ref.path}, private to {owner}: give it a "
            "public name in a neutral module (docs/architecture.md)"
        )
        if problem not in problems:
            problems.append(problem)
    return problems


def dependency_edges(refs: list[Reference], modules: set[str]) -> dict[str, set[str]]:
    """importer -> the package modules whose import it runs (rule 1)."""
    edges: dict[str, set[str]] = {}
    for ref in refs:
        target = ref.module
        parts = target.split(".")
        for depth in range(1, len(parts) + 1):
            needed = ".".join(parts[:depth])
            if needed == ref.importer:
                continue
            own_package = ref.importer.startswith(needed + ".")
            if depth < len(parts) and own_package:
                continue  # a package the importer is inside of is initializing already
            if needed in modules or needed == NATIVE:
                edges.setdefault(ref.importer, set()).add(needed)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> tuple[int, str] | None:
    best: tuple[int, int, str] | None = None  # (specificity, rank, name)
    for rank, name, patterns in LAYERS:
        for pattern in patterns:
            if pattern.endswith(".*"):
                prefix = pattern[:-2]
                matched = module.startswith(prefix + ".")
                specificity = len(prefix)
            else:
                matched = module == pattern
                specificity = len(pattern) + 1
            if matched and (best is None or specificity > best[0]):
                best = (specificity, rank, name)
    return None if best is None else (best[1], best[2])


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    problems = []
    for importer, targets in sorted(edges.items()):
        here = layer_of(importer)
        if here is None:
            problems.append(f"{importer} is in no layer: place it in LAYERS (test_import_graph)")
            continue
        for target in sorted(targets):
            there = layer_of(target)
            if there is None:
                problems.append(f"{target} is in no layer: place it in LAYERS (test_import_graph)")
            elif there[0] > here[0]:
                problems.append(
                    f"{importer} ({here[1]}) imports {target} ({there[1]}), a higher layer"
                )
            elif (
                there[0] == here[0]
                and here[1].startswith("backend:")
                and there[1] != here[1]
                and (importer, target) not in CROSS_BACKEND
            ):
                problems.append(
                    f"{importer} ({here[1]}) imports its sibling {target} ({there[1]}): move "
                    "what both need below them"
                )
    return problems


@dataclass
class Graph:
    modules: set[str]
    refs: list[Reference]
    edges: dict[str, set[str]]


def read_graph(sources: dict[str, tuple[str, bool]]) -> Graph:
    """The graph of `{module: (source text, is a package)}`."""
    modules = set(sources) | {NATIVE}
    refs = [
        ref
        for name, (text, is_package) in sorted(sources.items())
        for ref in references(name, text, is_package, modules)
    ]
    return Graph(modules, refs, dependency_edges(refs, modules))


def package_graph() -> Graph:
    return read_graph(
        {
            name: (path.read_text(encoding="utf-8"), _is_package(path))
            for name, path in module_names(PACKAGE_ROOT).items()
        }
    )


# The package itself ------------------------------------------------------------------------


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(package_graph().edges) == []


def test_no_module_uses_another_modules_private_name() -> None:
    assert private_violations(package_graph().refs) == []


def test_imports_point_down_the_layers() -> None:
    assert layer_violations(package_graph().edges) == []


def test_the_graph_sees_the_package() -> None:
    """The reader finds the imports it must (so an empty answer above means something)."""
    graph = package_graph()
    assert {"tokencapture.jobs", "tokencapture.ledger_rows"} <= graph.edges["tokencapture.ledger"]
    assert "tokencapture.ledger" in graph.edges["tokencapture.lineage"]
    assert "tokencapture.postgres._client" in graph.edges["tokencapture.postgres.store"]
    # `metrics` loads `_otel` in a function body, and the edge is counted.
    assert "tokencapture._otel" in graph.edges["tokencapture.metrics"]
    assert len(graph.modules) > 30


# The checker, on planted violations ---------------------------------------------------------


def _sources(mapping: dict[str, str], packages: frozenset[str] = frozenset()) -> Graph:
    return read_graph(
        {
            name: (textwrap.dedent(text), name in packages or name == "tokencapture")
            for name, text in {"tokencapture": "", **mapping}.items()
        }
    )


def test_a_cycle_through_a_deferred_import_is_found() -> None:
    graph = _sources(
        {
            "tokencapture.a": "from tokencapture.b import thing\n",
            "tokencapture.b": "def f():\n    from tokencapture import a\n    return a\n",
        }
    )
    assert cycles(graph.edges) == [["tokencapture.a", "tokencapture.b"]]


def test_a_cycle_under_type_checking_and_by_import_a_b_is_found() -> None:
    graph = _sources(
        {
            "tokencapture.a": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    import tokencapture.b\n",
            "tokencapture.b": "import tokencapture.c as c\n",
            "tokencapture.c": "from . import a\n",
        }
    )
    assert cycles(graph.edges) == [["tokencapture.a", "tokencapture.b", "tokencapture.c"]]


def test_a_cycle_through_a_package_init_is_found() -> None:
    """`tokencapture.sub.x` imports `tokencapture.other.y`, whose package's `__init__` imports
    `tokencapture.sub.x`: importing `y` runs that `__init__` first."""
    graph = _sources(
        {
            "tokencapture.sub": "",
            "tokencapture.sub.x": "from tokencapture.other.y import Y\n",
            "tokencapture.other": "from tokencapture.sub.x import X\n",
            "tokencapture.other.y": "Y = 1\n",
        },
        packages=frozenset({"tokencapture.sub", "tokencapture.other"}),
    )
    assert cycles(graph.edges) == [["tokencapture.other", "tokencapture.sub.x"]]


def test_a_submodule_taking_a_name_from_its_packages_init_is_a_cycle() -> None:
    graph = _sources(
        {
            "tokencapture": "from tokencapture.a import A\nB = 1\n",
            "tokencapture.a": "from tokencapture import B\nA = B\n",
        }
    )
    assert cycles(graph.edges) == [["tokencapture", "tokencapture.a"]]


def test_a_relative_import_and_import_module_are_edges() -> None:
    graph = _sources(
        {
            "tokencapture.p": "",
            "tokencapture.p.a": "from ..b import B\nfrom .c import C\n",
            "tokencapture.p.c": "import importlib\nimportlib.import_module('tokencapture.p.a')\n",
            "tokencapture.b": "B = 1\n",
        },
        packages=frozenset({"tokencapture.p"}),
    )
    assert graph.edges["tokencapture.p.a"] == {"tokencapture.b", "tokencapture.p.c"}
    assert cycles(graph.edges) == [["tokencapture.p.a", "tokencapture.p.c"]]


def test_importing_itself_is_no_cycle() -> None:
    graph = _sources({"tokencapture.a": "def main():\n    from tokencapture.a import main\n"})
    assert cycles(graph.edges) == []


@pytest.mark.parametrize(
    "code",
    [
        "from tokencapture.store import _native_job\n",
        "def f():\n    from tokencapture.store import _native_job\n",
        "import tokencapture.store\ntokencapture.store._native_job\n",
        "from tokencapture import store as s\ns._native_job()\n",
        "from .store import _native_job\n",
        "from tokencapture.p._hidden import Public\n",
        "import tokencapture.p._hidden\n",
    ],
)
def test_another_modules_private_name_is_refused(code: str) -> None:
    graph = _sources(
        {
            "tokencapture.store": "def _native_job(): ...\n",
            "tokencapture.p": "",
            "tokencapture.p._hidden": "Public = 1\n",
            "tokencapture.ledger": code,
        },
        packages=frozenset({"tokencapture.p"}),
    )
    [problem] = private_violations(graph.refs)
    assert problem.startswith("tokencapture.ledger (line ")


@pytest.mark.parametrize(
    ("importer", "code"),
    [
        ("tokencapture.x", "from tokencapture import _core\n_core._anything\n"),
        ("tokencapture.x", "from tokencapture._core import Store\n"),
        ("tokencapture.x", "from tokencapture.store import __version__, __all__\n"),
        ("tokencapture.x", "from tokencapture.store import TokenCaptureStore as _Store\n"),
        ("tokencapture.p.y", "from tokencapture.p._hidden import Public\n"),
        ("tokencapture.p", "from tokencapture.p import _hidden\n"),
        ("tokencapture.x", "from tokencapture import _otel\n"),
        ("tokencapture.store", "def _mine(): ...\n_mine()\n"),
    ],
)
def test_own_native_dunder_and_package_private_names_are_allowed(importer: str, code: str) -> None:
    graph = _sources(
        {
            "tokencapture.store": "TokenCaptureStore = 1\n",
            "tokencapture._otel": "",
            "tokencapture.p": "",
            "tokencapture.p._hidden": "Public = 1\n",
            importer: code,
        },
        packages=frozenset({"tokencapture.p"}),
    )
    assert private_violations(graph.refs) == []


def test_an_upward_or_sibling_backend_import_is_refused() -> None:
    graph = _sources(
        {
            "tokencapture.validation": "from tokencapture.store import TokenCaptureStore\n",
            "tokencapture.store": "",
            "tokencapture.postgres": "",
            "tokencapture.postgres.store": "from tokencapture.lineage import request_list\n",
            "tokencapture.postgres.transfer": "from tokencapture.store import TokenCaptureStore\n",
            "tokencapture.lineage": "",
            "tokencapture.newthing": "",
            "tokencapture.cli": "import tokencapture.newthing\n",
        },
        packages=frozenset({"tokencapture.postgres"}),
    )
    assert layer_violations(graph.edges) == [
        "tokencapture.newthing is in no layer: place it in LAYERS (test_import_graph)",
        "tokencapture.postgres.store (backend:postgres) imports its sibling "
        "tokencapture.lineage (backend:file): move what both need below them",
        "tokencapture.validation (core) imports tokencapture.store (backend:file), a higher layer",
    ]
