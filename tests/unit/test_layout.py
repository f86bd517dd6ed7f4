"""The package layout: no import cycle inside ``pipeline/``, and every package imports only the
packages below it (the code map in docs/architecture.md). Counted: every import a module runs
when it is imported — at module level, in a class body, under ``if TYPE_CHECKING:`` or in a
``try`` — plus the ``__init__`` of every package an import passes through. Each rule is
checked twice: with those alone, and with the imports inside functions too (they run later,
at call time, but a circle through one is still a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package (or top-level module) -> the pipeline packages it may import. Mirrors the
# code map in docs/architecture.md; the order is bottom to top.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "redact": set(),
    "config": {"errors", "redact"},
    "store": {"config", "errors", "http"},  # the wire format checks with http.rules
    "http": {"redact"},
    "gates": {"store", "config", "errors", "redact", "http"},  # metric gates GET with http.call
    "client": {"gates", "store", "config", "errors", "http"},  # submit checks with http.rules
    "observability": {"client", "gates", "store", "config", "errors", "redact"},
    "worker": {"observability", "http", "gates", "store", "config", "errors", "redact"},
    "dispatch": {"observability", "gates", "store", "config", "errors"},
    "sim": set(),
    # batches as objects, their file formats and the `pipeline run` client: on the client API
    "batch": {"client", "store", "config", "errors"},
    # the HTTP service (`pipeline serve`): OpenAI's Files and Batches API over `batch`
    "serve": {"batch", "client", "store", "config", "errors", "redact"},
    "cli": {
        "batch",
        "client",
        "config",
        "dispatch",
        "errors",
        "gates",
        "http",
        "observability",
        "redact",
        "serve",
        "sim",
        "store",
        "worker",
    },  # fmt: skip
    "__init__": {"batch", "client", "config", "errors"},
    "__main__": {"cli"},
}


def module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package rooted at package_dir."""
    top = package_dir.name
    out: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([top, *parts])] = path
    return out


def _import_time_nodes(
    body: list[ast.stmt], deferred: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module runs: not inside a function (``deferred``:
    those inside functions too, which run at call time)."""
    if deferred:
        return [n for s in body for n in ast.walk(s) if isinstance(n, ast.Import | ast.ImportFrom)]
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    stmts = [s for s in block if isinstance(s, ast.stmt | ast.ExceptHandler)]
                    for s in stmts:
                        if isinstance(s, ast.ExceptHandler):
                            found.extend(_import_time_nodes(s.body))
                        else:
                            found.extend(_import_time_nodes([s]))
    return found


def import_graph(package_dir: Path, deferred: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules its import runs (see the module docstring);
    ``deferred``: and those its functions import when called."""
    modules = module_names(package_dir)
    top = package_dir.name
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]
        targets: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _import_time_nodes(tree.body, deferred):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets.add(mod)
            targets.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules)
        edges: set[str] = set()
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        for t in targets:
            if t != top and not t.startswith(top + "."):
                continue
            parts = t.split(".")
            for i in range(1, len(parts) + 1):  # the target and the packages it passes through
                step = ".".join(parts[:i])
                if step in modules and step not in own:
                    edges.add(step)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.mark.parametrize("deferred", [False, True], ids=["at-import", "with-deferred"])
def test_no_import_cycle_inside_pipeline(deferred: bool) -> None:
    """None when modules are imported, and none through an import deferred into a function
    either (a circle hidden at call time is still a circle: gates/ had composite ->
    registry -> composite, tier)."""
    graph = import_graph(ROOT / "pipeline", deferred)
    assert len(graph) > 40  # the walk found the package
    assert cycles(graph) == []


@pytest.mark.parametrize("deferred", [False, True], ids=["at-import", "with-deferred"])
def test_every_package_imports_only_the_packages_below_it(deferred: bool) -> None:
    graph = import_graph(ROOT / "pipeline", deferred)
    wrong = sorted(
        f"{src} -> {dst}"
        for src, dsts in graph.items()
        for dst in dsts
        if package_of(dst) != package_of(src)
        and package_of(dst) not in ALLOWED.get(package_of(src), set())
    )
    assert wrong == []
    assert set(ALLOWED) == {package_of(m) for m in graph}  # every package has its row


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (  # a -> b -> a at module level
            {"a.py": "from . import b\n", "b.py": "from .a import x\n"},
            [["p.a", "p.b"]],
        ),
        (  # under TYPE_CHECKING counts too
            {
                "a.py": "import typing\nif typing.TYPE_CHECKING:\n    from .b import y\n",
                "b.py": "from .a import x\n",
            },
            [["p.a", "p.b"]],
        ),
        (  # through a package __init__: q.m imports p.a, whose import runs q/__init__
            {
                "a.py": "from .q.n import z\n",
                "q/__init__.py": "from .m import w\n",
                "q/m.py": "from ..a import v\n",
                "q/n.py": "",
            },
            [["p.a", "p.q", "p.q.m"]],
        ),  # fmt: skip
        (  # inside a function: runs later, not a cycle at import time
            {"a.py": "def f():\n    from . import b\n", "b.py": "from .a import x\n"},
            [],
        ),
    ],
)
def test_the_cycle_check_finds_cycles(
    tmp_path: Path, files: dict[str, str], expected: list[list[str]]
) -> None:
    pkg = tmp_path / "p"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    assert cycles(import_graph(pkg)) == expected


def test_the_key_prefix_has_one_home() -> None:
    """Its default spelled once and ``PIPELINE_KEY_PREFIX`` read once, in ``pipeline/config``
    (``DEFAULT_KEY_PREFIX``, ``key_prefix()``); everything else asks them."""
    files = [*sorted((ROOT / "pipeline").rglob("*.py")), *sorted((ROOT / "tasks").rglob("*.py"))]
    found: dict[str, list[str]] = {"pl:": [], "PIPELINE_KEY_PREFIX": []}
    for path in [*files, ROOT / "celeryconfig.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in found:
                found[node.value].append(str(path.relative_to(ROOT)))
    assert found == {
        "pl:": ["pipeline/config/settings.py"],
        "PIPELINE_KEY_PREFIX": ["pipeline/config/load.py"],
    }


def test_the_cycle_check_finds_a_circle_deferred_into_a_function(tmp_path: Path) -> None:
    pkg = tmp_path / "p"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "a.py": "class C:\n    def m(self):\n        from .b import y\n",
        "b.py": "from .a import C\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    assert cycles(import_graph(pkg)) == []
    assert cycles(import_graph(pkg, deferred=True)) == [["p.a", "p.b"]]
