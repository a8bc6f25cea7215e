"""The project's modules import each other without a cycle, imports inside functions included.

A cycle hidden behind a function-level import still couples the two modules both ways (each needs the other to
work) and breaks as soon as someone moves the import to the top. The graph is read from the source (ast), so the
test needs no import of the project and no compile."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
    module. Imports under `if TYPE_CHECKING:` (annotations only, never run) are not edges."""
    is_pkg = path.name == "__init__.py"
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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


def _is_type_checking_block(node) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports for annotations only, never executed."""
    if not isinstance(node, ast.If):
        return False
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


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
    src = "def f():\n    from hisparse_jax.kv import ops\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))


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
