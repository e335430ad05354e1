"""The package's layout is its architecture: layers as subpackages, imports only downwards, no cycles, small modules.

Every module under ``arraycheckpoint/`` is parsed with :mod:`ast` (nothing is imported) and every import of
``arraycheckpoint.*`` collected: module-level ones, the ones inside functions (lazy) and the ``TYPE_CHECKING``
ones, relative imports resolved. Then:

(a) the module-level imports form no cycle;
(b) every import, lazy ones too, goes to the same or a lower layer of :data:`LAYERS` (the order the
    subpackages' docstrings and docs/architecture.md describe), except the few in :data:`EXCEPTIONS`, each
    with its reason;
(c) no module is over :data:`MAX_LINES` lines (:data:`TOO_LONG`: known exceptions);
(d) at most :data:`MAX_TOP_LEVEL` modules sit at the package's top level (the public API and its errors).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = "arraycheckpoint"

#: The layers, lowest first: a module may import its own layer and the layers before it. A module belongs
#: to the layer of the longest prefix naming it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("arraycheckpoint.errors",)),
    ("codecs", ("arraycheckpoint.codecs",)),
    ("checks", ("arraycheckpoint.checks",)),
    ("planning", ("arraycheckpoint.planning",)),
    ("format", ("arraycheckpoint.format",)),
    ("runtime", ("arraycheckpoint.runtime",)),
    ("adapters", ("arraycheckpoint.adapters", "arraycheckpoint.data")),
    ("storage", ("arraycheckpoint.storage",)),
    ("audit", ("arraycheckpoint.audit",)),
    ("sources", ("arraycheckpoint.sources",)),
    ("engine", ("arraycheckpoint.engine",)),
    ("interop", ("arraycheckpoint.interop",)),
    ("api", ("arraycheckpoint",)),  # the package's top-level modules (errors aside)
    ("tools", ("arraycheckpoint.tools",)),
    ("cli", ("arraycheckpoint.cli",)),
    ("main", ("arraycheckpoint.__main__",)),  # ``python -m arraycheckpoint``: the command line, nothing else
    ("testing", ("arraycheckpoint.testing",)),
]

#: Deliberate upward imports (all lazy: inside a function), each with its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("arraycheckpoint.adapters.torch.megatron_convert", "arraycheckpoint.engine"): (
        "converting a megatron checkpoint's stacked layers reads through the engine (a tool's helper that "
        "lives beside the megatron adapter it inverts)"
    ),
}

MAX_LINES = 600
#: Modules allowed over MAX_LINES, with the reason.
TOO_LONG: dict[str, str] = {}
MAX_TOP_LEVEL = 12


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module
    path: str  # the importing file, relative to the repository
    line: int
    lazy: bool  # inside a function
    typing_only: bool  # under ``if TYPE_CHECKING:``


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for p in sorted((ROOT / PKG).rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (p, is_pkg)
    return mods


MODULES = _modules()


def _known(name: str) -> str:
    """The longest prefix of ``name`` that is a module of the package."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _imports_of(mod: str, path: Path, is_pkg: bool) -> list[Import]:
    """Every import of ``arraycheckpoint.*`` in module ``mod`` (the file ``path``)."""
    package = mod.split(".") if is_pkg else mod.split(".")[:-1]
    rel = str(path.relative_to(ROOT))
    found: list[Import] = []
    todo: list[tuple[ast.AST, bool, bool]] = [(ast.parse(path.read_text(), filename=rel), False, False)]
    while todo:
        node, lazy, typing_only = todo.pop()
        for child in ast.iter_child_nodes(node):
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names if a.name == PKG or a.name.startswith(PKG + ".")]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - (child.level - 1)]
                    full = ".".join(base + ([child.module] if child.module else []))
                else:
                    full = child.module or ""
                if full == PKG or full.startswith(PKG + "."):  # `from pkg import submodule`: the submodule
                    targets = [
                        f"{full}.{a.name}" if f"{full}.{a.name}" in MODULES else full for a in child.names
                    ]
            for t in targets:
                found.append(Import(mod, _known(t), rel, child.lineno, lazy, typing_only))
            inner_lazy = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            inner_typing = typing_only or (
                isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            )
            todo.append((child, inner_lazy, inner_typing))
    return found


def _imports() -> list[Import]:
    return [i for mod, (path, is_pkg) in MODULES.items() for i in _imports_of(mod, path, is_pkg)]


IMPORTS = _imports()


def _layer(module: str) -> tuple[int, str]:
    best: tuple[int, int, str] | None = None  # (prefix length, index, name)
    for i, (name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), i, name)
    assert best is not None, f"{module} is in no layer: add its package to LAYERS in tests/test_layers.py"
    return best[1], best[2]


def _where(i: Import) -> str:
    kind = "lazy import" if i.lazy else "TYPE_CHECKING import" if i.typing_only else "import"
    return f"{i.path}:{i.line}: {kind} of {i.target}"


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    line: dict[tuple[str, str], Import] = {}
    for i in IMPORTS:
        if not (i.lazy or i.typing_only) and i.target != i.source:
            graph[i.source].add(i.target)
            line.setdefault((i.source, i.target), i)
    # Tarjan's strongly connected components (iterative)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    messages = []
    for comp in cycles:
        members = set(comp)
        edges = [_where(line[(a, b)]) for a in comp for b in sorted(graph[a] & members)]
        messages.append(f"cycle among {', '.join(comp)}:\n    " + "\n    ".join(edges))
    assert not cycles, "module-level import cycles (move the shared code down a layer):\n" + "\n".join(
        messages
    )


def test_imports_go_down_the_layers() -> None:
    wrong = []
    used = set()
    for i in IMPORTS:
        (src_rank, src_name), (dst_rank, dst_name) = _layer(i.source), _layer(i.target)
        if dst_rank <= src_rank:
            continue
        if (i.source, i.target) in EXCEPTIONS:
            used.add((i.source, i.target))
            assert i.lazy, f"{_where(i)}: a listed exception must stay lazy (inside a function)"
            continue
        wrong.append(f"{_where(i)} goes up from layer {src_name!r} to layer {dst_name!r}")
    assert not wrong, (
        "imports must go to the same or a lower layer (LAYERS in tests/test_layers.py, lowest first: "
        + " < ".join(n for n, _ in LAYERS)
        + "):\n  "
        + "\n  ".join(wrong)
    )
    stale = set(EXCEPTIONS) - used
    assert not stale, f"EXCEPTIONS lists imports that no longer go up (remove them): {sorted(stale)}"


def test_every_layer_documents_what_it_may_import() -> None:
    for _name, prefixes in LAYERS:
        for p in prefixes:
            path, is_pkg = MODULES[p]
            if not is_pkg or p == PKG:
                continue
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and "import" in doc, (
                f"{path.relative_to(ROOT)}: its docstring must say what the layer may import"
            )


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p, _ in MODULES.values()))
def test_module_size(path: str) -> None:
    lines = (ROOT / path).read_text().count("\n")
    if path in TOO_LONG:
        return
    assert lines <= MAX_LINES, f"{path} has {lines} lines (at most {MAX_LINES}): split it along its seams"


def test_known_long_modules_are_still_long() -> None:
    for path in TOO_LONG:
        assert (ROOT / path).is_file(), f"TOO_LONG lists {path}, which is gone: remove it"
        lines = (ROOT / path).read_text().count("\n")
        assert lines > MAX_LINES, f"{path} is {lines} lines now: remove it from TOO_LONG"


def test_few_modules_at_the_top_level() -> None:
    top = sorted(p.name for p in (ROOT / PKG).glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, (
        f"{len(top)} modules at arraycheckpoint/'s top level (at most {MAX_TOP_LEVEL}: the public API and its "
        f"errors; put the rest in the layer they belong to): {', '.join(top)}"
    )
