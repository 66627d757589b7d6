"""The package's layout, read from its source (nothing is imported, no model is built).

Imports in tinygpt run one way: from later days to earlier ones, and from the benchmarks and the
server down to what they measure or serve. Two checks keep it so:

- import_graph parses every tinygpt/**/*.py with ast and keeps the imports that run when the
  module is imported: top-level `import` / `from ... import` statements (relative ones too, and
  those under a module-level if / try / with / class), but not those inside a function or under
  `if TYPE_CHECKING:`. `from tinygpt import x` counts as importing tinygpt.x when x is a module;
  a package's __init__ imports what it imports. find_cycles then reports every cycle as
  `tinygpt.a -> tinygpt.b -> tinygpt.a`.
- No module outside tinygpt.bench loads tinygpt.bench when it is imported: importing anything
  inside that package runs its __init__, which loads every benchmark row (day 13's batching and
  day 17's engine read day 12's request metrics from tinygpt.metrics instead).

And one of size: no module is over MAX_LINES lines unless LONG_MODULES names it, with its reason.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "tinygpt"
README = PACKAGE_DIR.parent / "README.md"

MAX_LINES = 600
DAY_MODULE = "one course day's module, read whole alongside its notebook"
# tinygpt-relative path -> why it may be longer than MAX_LINES (one line each)
LONG_MODULES: dict[str, str] = {
    "tokenizer.py": f"day 02: {DAY_MODULE}",
    "model.py": f"day 05: {DAY_MODULE} (day 20's MoE and day 21's long-context fields)",
    "train.py": f"day 06: {DAY_MODULE}",
    "roofline.py": f"day 10: {DAY_MODULE}",
    "kv_cache.py": f"day 11: {DAY_MODULE}",
    "batching.py": f"day 13: {DAY_MODULE}",
    "quant.py": f"day 15: {DAY_MODULE}",
    "engine.py": f"day 17: {DAY_MODULE}",
    "constrained.py": f"day 19: {DAY_MODULE}",
    "cpu_kernels.py": "the C decode kernels' Python side: products, dense and MoE layers",
}


# --------------------------------------------------------------------------------------------
# the import graph


def _module_name(root: Path, path: Path, package: str) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(body: list[ast.stmt]):
    """The Import / ImportFrom nodes of `body` that run when the module is imported."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue                                    # runs when called, not on import
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _runtime_imports(node.orelse)    # the body is for type checkers only
        else:                       # if / try / with / for / class bodies run on import
            for _, value in ast.iter_fields(node):
                for item in value if isinstance(value, list) else []:
                    if isinstance(item, ast.stmt):
                        yield from _runtime_imports([item])
                    elif isinstance(item, ast.excepthandler | ast.match_case):
                        yield from _runtime_imports(item.body)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` (whose source folder is `root`) it imports at module
    level, by dotted name; a package is named by its __init__ ("tinygpt.bench")."""
    root = Path(root)
    paths = {_module_name(root, p, package): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        deps: set[str] = set()

        def add(name: str, module: str = module, deps: set[str] = deps) -> None:
            parts = name.split(".")            # import a.b.c: the deepest module of ours
            for end in range(len(parts), 0, -1):
                if ".".join(parts[:end]) in paths:
                    if ".".join(parts[:end]) != module:
                        deps.add(".".join(parts[:end]))
                    return

        for node in _runtime_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name)
                continue
            if node.level:                      # relative: from the module's own package up
                base = module.split(".")[: None if is_package else -1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not (source == package or source.startswith(package + ".")):
                continue
            for alias in node.names:            # from pkg import submodule: that module
                if f"{source}.{alias.name}" in paths:
                    add(f"{source}.{alias.name}")
                else:                           # a name defined by the module itself
                    add(source)
        graph[module] = deps
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through the first module (by name) of each strongly connected group
    of modules, as [a, b, ..., a]; [] when the graph has no cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:                # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for group in sorted(groups):
        start, members = group[0], set(group)
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:                            # breadth first, back to start
            v = queue.popleft()
            nxt = [w for w in sorted(graph.get(v, ())) if w in members]
            if start in nxt:
                path = [start]
                while v != start:
                    path.append(v)
                    v = came_from[v]
                cycles.append([start, *reversed(path[1:]), start])
                break
            for w in nxt:
                if w not in came_from and w != start:
                    came_from[w] = v
                    queue.append(w)
    return cycles


def import_chain(graph: dict[str, set[str]], start: str, wanted) -> list[str] | None:
    """The shortest chain of run-time imports from `start` to a module for which
    wanted(module) holds, counting that importing a.b.c runs a/__init__ and a/b/__init__ first;
    None when there is none."""
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if v != start and wanted(v):
            chain = [v]
            while came_from[chain[-1]] is not None:
                chain.append(came_from[chain[-1]])
            return chain[::-1]
        parents = [".".join(v.split(".")[:i]) for i in range(1, v.count(".") + 1)]
        for w in sorted(graph.get(v, set()) | {p for p in parents if p in graph}):
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    return None


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# --------------------------------------------------------------------------------------------
# tests


def test_tinygpt_has_no_import_cycle():
    graph = import_graph(PACKAGE_DIR, "tinygpt")
    # the parse sees the imports it should (a run-time one, a package's, a type-only one)
    assert "tinygpt.model" in graph["tinygpt.flops"]
    assert "tinygpt.bench.registry" in graph["tinygpt.bench"]
    assert "tinygpt.kv_cache" not in graph["tinygpt.model"]         # under TYPE_CHECKING
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in tinygpt (make one of each a later-day import):\n" + \
        "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_graph_finds_a_cycle_in_a_cyclic_package(tmp_path):
    """The same functions on a made-up package whose a -> b -> sub.d -> a import cycle goes
    through a relative import, a `from pkg import module` and a plain `import pkg.module`, next
    to imports that must not count (type-only, inside a function)."""
    root = tmp_path / "fakepkg"
    _write(root, {
        "__init__.py": "from fakepkg.a import A\n",
        "a.py": ("from typing import TYPE_CHECKING\n\nfrom . import b\n\n"
                 "if TYPE_CHECKING:\n    from fakepkg.c import C\n\n"
                 "A = 1\n\n\ndef late():\n    from fakepkg.c import C\n    return C\n"),
        "b.py": "from .sub.d import D\n",
        "c.py": "from fakepkg import a\n\nC = a.A\n",
        "sub/__init__.py": "",
        "sub/d.py": "import fakepkg.a\n\nD = 2\n",
    })
    graph = import_graph(root, "fakepkg")
    assert graph == {"fakepkg": {"fakepkg.a"}, "fakepkg.a": {"fakepkg.b"},
                     "fakepkg.b": {"fakepkg.sub.d"}, "fakepkg.c": {"fakepkg.a"},
                     "fakepkg.sub": set(), "fakepkg.sub.d": {"fakepkg.a"}}
    cycles = find_cycles(graph)
    assert [" -> ".join(c) for c in cycles] == \
        ["fakepkg.a -> fakepkg.b -> fakepkg.sub.d -> fakepkg.a"]

    _write(root, {"sub/d.py": "def d():\n    import fakepkg.a\n    return fakepkg.a\n"})
    assert find_cycles(import_graph(root, "fakepkg")) == []

    _write(root, {"c.py": "from fakepkg.c import C\n\nC = 3\n",      # a module importing itself
                  "sub/__init__.py": "from fakepkg.sub import d\n",   # its own submodule: fine
                  "sub/d.py": "from .. import c\nfrom fakepkg import sub\n"})
    assert [" -> ".join(c) for c in find_cycles(import_graph(root, "fakepkg"))] == \
        ["fakepkg.sub -> fakepkg.sub.d -> fakepkg.sub"]


def test_the_course_modules_do_not_load_the_benchmark_suite():
    """Importing tinygpt.bench.<anything> runs tinygpt/bench/__init__.py, which loads every row
    of `python -m tinygpt bench`: the modules below it (every other module) must not import it
    when they load; a later day that needs day 12's request metrics uses tinygpt.metrics."""
    graph = import_graph(PACKAGE_DIR, "tinygpt")
    in_bench = lambda m: m == "tinygpt.bench" or m.startswith("tinygpt.bench.")  # noqa: E731
    chains = [chain for m in sorted(graph) if not in_bench(m)
              if (chain := import_chain(graph, m, in_bench)) is not None]
    assert not chains, "modules that load the benchmark suite when imported:\n" + \
        "\n".join(" -> ".join(chain) for chain in chains)


def test_import_chain_counts_the_parent_packages(tmp_path):
    root = tmp_path / "fakepkg"
    _write(root, {"__init__.py": "", "day.py": "from fakepkg.suite.metrics import ttft\n",
                  "suite/__init__.py": "from fakepkg.suite import rows\n",
                  "suite/metrics.py": "def ttft():\n    return 0\n", "suite/rows.py": ""})
    graph = import_graph(root, "fakepkg")
    assert import_chain(graph, "fakepkg.day", lambda m: m.endswith(".rows")) == \
        ["fakepkg.day", "fakepkg.suite.metrics", "fakepkg.suite", "fakepkg.suite.rows"]
    assert import_chain(graph, "fakepkg.suite.rows", lambda m: m == "fakepkg.day") is None


def test_no_module_is_over_the_line_limit_unless_listed():
    lines = {path.relative_to(PACKAGE_DIR).as_posix(): len(path.read_text().splitlines())
             for path in sorted(PACKAGE_DIR.rglob("*.py"))}
    too_long = {name: n for name, n in lines.items()
                if n > MAX_LINES and name not in LONG_MODULES}
    assert not too_long, (f"modules over {MAX_LINES} lines: {too_long}; split them, or add "
                          f"them to LONG_MODULES with a one-line reason")
    stale = {name: lines.get(name) for name in LONG_MODULES
             if lines.get(name, 0) <= MAX_LINES}
    assert not stale, (f"LONG_MODULES lists modules that are no longer over {MAX_LINES} lines "
                       f"(None: gone): {stale}; remove their entries")
    assert all(reason.strip() and "\n" not in reason for reason in LONG_MODULES.values())


def test_every_module_is_named_in_the_package_docstring_and_the_readme_layout():
    """A newcomer finds each module from two places: the package docstring's one-line table and
    the README's Layout section. A module missing from either is found only by listing files."""
    import tinygpt

    layout = README.read_text().split("## Layout", 1)[1]
    names = sorted(p.stem for p in PACKAGE_DIR.glob("*.py") if not p.stem.startswith("__"))
    names += sorted(p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").exists())
    in_docstring = set(re.findall(r"^    (\w+)\s", tinygpt.__doc__, flags=re.MULTILINE))
    missing = [n for n in names if n not in in_docstring]
    assert not missing, f"not in tinygpt/__init__.py's module table: {missing}"
    missing = [n for n in names if not re.search(rf"\b{n}(\.py|/)", layout)]
    assert not missing, f"not in README.md's Layout section: {missing}"
