"""The project's modules import each other without a cycle, imports inside functions and under `if TYPE_CHECKING:`
included.

A cycle hidden behind a function-level import still couples the two modules both ways (each needs the other to
work) and breaks as soon as someone moves the import to the top; one hidden behind a `TYPE_CHECKING` import is a
module written against the other's class (a class cut into files that import it back). The graph is read from the
source (ast), so the test needs no import of the project and no compile."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("hisparse_jax", "pallas_kernels")


def project_modules() -> dict[str, pathlib.Path]:
    """{dotted module name: file} of every module of the project's packages (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file, functions included: `import a.b`, `from a import b`
    (b a module or a name of a), relative imports resolved; an imported name that is not a module counts as its
    module. Imports under `if TYPE_CHECKING:` count too: a module that names another's class in its annotations
    is written against it."""
    is_pkg = path.name == "__init__.py"
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {name: imported_modules(name, path, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions included):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_cycles():
    """The finder itself: a cycle through a function-level import is one."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_type_checking_imports_are_edges(tmp_path):
    """An import under `if TYPE_CHECKING:` and one inside a function are edges of the graph the cycle test reads."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    known = {"pkg", "pkg.a", "pkg.b"}
    assert imported_modules("pkg.a", pkg / "a.py", known) == {"pkg.b"}
    assert imported_modules("pkg.b", pkg / "b.py", known) == {"pkg.a"}


def test_kernels_import_nothing_of_the_library():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("pallas_kernels"):
            assert not {d for d in deps if d.startswith("hisparse_jax")}, (name, deps)


def test_one_page_size_and_one_sentinel():
    """The kernels import only jax, so they state the page size and the "none" sentinel themselves; the library
    states each once (`config.PAGE_SIZE`, `kv.pool.INVALID`), and the two agree."""
    from hisparse_jax.units import PAGE_SIZE
    from hisparse_jax.units import INVALID
    from pallas_kernels.common import INVALID as KERNEL_INVALID
    from pallas_kernels.common import PAGE

    assert (PAGE_SIZE, INVALID) == (PAGE, KERNEL_INVALID) == (64, -1)
    for name, path in project_modules().items():
        if name.startswith("hisparse_jax") and name != "hisparse_jax.units":
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in (
                        "PAGE_SIZE", "PAGE", "PAGE_TOKENS", "INVALID") for t in node.targets):
                    raise AssertionError(f"{name} defines {ast.unparse(node)}: import it instead")
