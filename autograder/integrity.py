"""Grading integrity: submissions that try to fake their grade are caught or flagged.

Student code shares the kernel with the test cells, so it can make tests pass without solving
anything: rebind a check function, patch `numpy.allclose`, install an IPython input transformer
or event hook that blanks or rewrites the next cell, swallow the test's exception, put the
package's finished function in place of its own, or read the tests. Stock nbgrader notices none
of it. Two defences, both cheap:

Prevention (runtime, autograder/guard.py): before any student code runs, the grader installs a guard
in the kernel that records the state the tests rely on: IPython's input and AST transformers,
its event callbacks, the shell and kernel methods that run a cell and show its errors, the
tracing hooks, `builtins`, the comparison and check functions of numpy, torch, math and
`tinygpt.testing`, and the notebook's names for them. Before every test cell the grader asks the
guard, through the kernel's `user_expressions` channel (evaluated without input transformers or
cell hooks), to compare and restore that state. Whatever was changed is put back, so the test
runs as written, and the change becomes evidence. The guard's answers are signed, and the
grader also checks the kernel's messages (autograder/kernel.py: a forged idle status) and never
lets a test cell's output stand for partial credit (autograder/preprocessors.py).

Detection (static, `scan_submission`): every code cell the student wrote or edited is parsed
and searched for the means of tampering: IPython internals, frame and tracing tricks, dynamic
code (exec, eval, __import__), assignments to attributes of imported modules, changes to
sys.modules or the guard, the kernel's display hook and messaging, rebinding the check
functions, comparison overrides (__eq__ that can say yes to anything), reading notebook
files or the kernel's input history, importing the package's finished version of the function
under test, and an answer that calls a function a test cell defines, directly or through the
student's own functions (a visible test's reference runs in the same kernel: an answer that
only calls it passes the tests that compare values).

A submission with evidence is graded as usual (prevented tampering no longer earns points) and
gets the status `flagged` with the evidence, for manual review. What remains possible: code
that defeats the guard from inside the kernel (it can read and patch anything there) without
using any means the static scan knows; the scan then still flags the dynamic features such code
needs in practice. See the README's instructor section.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from autograder.notebooks import is_answer, is_test, nbgrader_meta

FLAGGED = "flagged"


@dataclass(frozen=True)
class Evidence:
    kind: str     # a short category, e.g. "ipython-hooks", "patched-module"
    where: str    # the cell it was found in or before (grade_id or "cell N")
    detail: str   # what exactly, for the reviewer

    def text(self) -> str:
        return f"{self.kind} in {self.where}: {self.detail}"


def summarize(evidence: list[Evidence], limit: int = 6) -> str:
    """One line for the summary table: distinct findings, the first `limit` of them."""
    texts = list(dict.fromkeys(e.text() for e in evidence))
    more = f"; and {len(texts) - limit} more" if len(texts) > limit else ""
    return "; ".join(texts[:limit]) + more


# --------------------------------------------------------------------------------------------
# static scan of the cells a student wrote


IPYTHON_ATTRS = {
    "input_transformers_cleanup", "input_transformers_post", "ast_transformers",
    "input_transformer_manager", "set_custom_exc", "showtraceback", "_showtraceback",
    "showsyntaxerror", "custom_exceptions", "CustomTB", "InteractiveTB", "run_cell",
    "run_cell_async", "transform_cell", "user_expressions", "history_manager", "do_execute",
    "register_magic_function", "user_ns", "user_global_ns",
}
FRAME_ATTRS = {"settrace", "setprofile", "_getframe", "f_back", "f_locals", "f_globals",
               "f_code", "tb_frame", "gi_frame", "__closure__", "cell_contents"}
# the kernel's display hook (an execute_result from inside a test) and its messaging (a forged
# status or reply); sys.displayhook reaches both
KERNEL_ATTRS = {"displayhook", "session", "pub_socket", "parent_header", "iopub_socket",
                "iopub_thread", "shell_stream", "shell_streams"}
SYS_MODULES_CHANGES = {"update", "pop", "popitem", "setdefault", "clear", "__setitem__",
                       "__delitem__"}
GUARD_NAME = "_tinygpt"     # the grader's guard lives in sys.modules under a name starting so
SUSPECT_MODULES = {
    "builtins": "patched-builtins", "inspect": "introspection", "gc": "introspection",
    "ctypes": "introspection", "linecache": "reads-tests", "IPython": "ipython-hooks",
    "ipykernel": "ipython-hooks", "importlib": "dynamic-code", "nbformat": "reads-tests",
    "marshal": "dynamic-code", "dis": "introspection",
}
DYNAMIC_CALLS = {"exec", "eval", "compile", "__import__", "globals", "vars", "breakpoint"}
HISTORY_NAMES = {"_ih", "_oh", "_dh", "In", "Out", "_i", "_ii", "_iii", "_"}
COMPARISON_DUNDERS = {"__eq__", "__ne__", "__bool__", "__array__", "__array_ufunc__",
                      "__array_function__", "__torch_function__", "__instancecheck__",
                      "__float__", "__len__"}
NOTEBOOK_FILE = re.compile(r"\.ipynb|\.ipynb_checkpoints|gradebook|/solutions\b")


def _strip_magics(source: str) -> str:
    """IPython magics and shell escapes are not Python: blank them before parsing."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def _parse(source: str) -> tuple[ast.Module | None, str]:
    """(the AST of `source`, magics blanked, ""), or (None, why not): "" for a syntax error
    (it fails on its own: nothing runs), a sentence for code nested too deep or too large for
    the parser (unreadable to the scan, so itself a reason for review)."""
    try:
        return ast.parse(_strip_magics(source)), ""
    except (SyntaxError, ValueError):
        return None, ""
    except (RecursionError, MemoryError) as err:
        return None, f"code too deeply nested or too large to parse ({type(err).__name__})"


def _nodes(sources: list[str]):
    """Every AST node of every source that parses (magics blanked)."""
    for source in sources:
        tree, _ = _parse(source)
        if tree is not None:
            yield from ast.walk(tree)


def module_aliases(sources: list[str]) -> dict[str, str]:
    """alias -> module for every `import m [as a]` / `from p import m [as a]` (of a module)
    in `sources`: the names a notebook uses for numpy, torch, tinygpt modules and so on."""
    aliases: dict[str, str] = {}
    for node in _nodes(sources):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                aliases[a.asname or top] = a.name if a.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:    # `from tinygpt import flops as F` binds a module
                if node.module == "tinygpt" or node.module.startswith(("torch", "numpy")):
                    aliases.setdefault(a.asname or a.name, f"{node.module}.{a.name}")
    return aliases


def check_names(sources: list[str]) -> set[str]:
    """The names the notebook imports from tinygpt.testing (check_close, check_true, ...)."""
    return {a.asname or a.name for node in _nodes(sources)
            if isinstance(node, ast.ImportFrom) and node.module == "tinygpt.testing"
            for a in node.names}


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001
        return type(node).__name__


def _text(node: ast.AST) -> str | None:
    """The string a constant expression spells ("_tinygpt" + "_guard", f"{'a'}b"), else None."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return left + right if left is not None and right is not None else None
    if isinstance(node, ast.JoinedStr):
        parts = [_text(v.value if isinstance(v, ast.FormattedValue) else v) for v in node.values]
        return "".join(parts) if None not in parts else None
    return None


def _is_sys(node: ast.AST, aliases: dict[str, str]) -> bool:
    return isinstance(node, ast.Name) and aliases.get(node.id, node.id) == "sys"


def _changes_sys_modules(node: ast.Attribute, parent: ast.AST | None) -> bool:
    """Whether `node` (sys.modules) is written, deleted from, changed by a method, or bound to
    another name (through which it could be changed unseen); reading it is not flagged."""
    if isinstance(parent, ast.Subscript):
        return not isinstance(parent.ctx, ast.Load)
    if isinstance(parent, ast.Attribute):
        return parent.attr in SYS_MODULES_CHANGES
    return isinstance(parent, ast.Assign | ast.AnnAssign | ast.NamedExpr | ast.AugAssign)


def scan_source(source: str, *, aliases: dict[str, str], protected: set[str],
                exercise_names: set[str], answer: bool = True,
                permitted: frozenset[tuple[str, str]] = frozenset()) -> list[tuple[str, str]]:
    """(kind, detail) for every means of tampering found in one cell's source.

    aliases: the notebook's module aliases (module_aliases); protected: names the tests rely
    on (check functions, module aliases); exercise_names: the functions under test.
    answer: the cell is an answer cell; in another cell (a scratch cell) importing tinygpt's
    finished version of an exercise under a name of its own is exploring (scan_submission
    follows where that name is used), under the exercise's own name it is a reference copy.
    permitted: (module, name) imports this cell may make (PERMITTED_IMPORTS).
    """
    tree, unreadable = _parse(source)
    if tree is None:
        return [("unreadable-code", unreadable)] if unreadable else []
    found: list[tuple[str, str]] = []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def add(kind: str, detail: str) -> None:
        if (kind, detail) not in found:
            found.append((kind, detail))

    for node in ast.walk(tree):
        text = _text(node) if isinstance(node, ast.BinOp | ast.JoinedStr) else None
        if text is not None and GUARD_NAME in text:
            add("guard-tampering", f"names the grader's guard (a string with {GUARD_NAME!r})")
        if isinstance(node, ast.Name):
            if node.id == "get_ipython":
                add("ipython-hooks", "calls get_ipython()")
            elif node.id in HISTORY_NAMES - {"_"} or re.fullmatch(r"_i\d+|_\d+", node.id):
                add("reads-tests", f"reads the kernel's input/output history ({node.id})")
            elif node.id == "__builtins__":
                add("patched-builtins", "uses __builtins__")
        elif isinstance(node, ast.Attribute):
            if node.attr in IPYTHON_ATTRS:
                add("ipython-hooks", f"uses IPython's {node.attr}")
            elif node.attr in FRAME_ATTRS:
                add("introspection", f"uses {_dotted(node)} (frames or tracing)")
            elif node.attr in KERNEL_ATTRS:
                add("ipython-hooks", f"uses the kernel's {node.attr} (its display hook or "
                                     f"messages)")
            elif node.attr == "linecache":
                add("reads-tests", f"uses {_dotted(node)} (the source of the cells run)")
            elif node.attr == "register" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "events":
                add("ipython-hooks", "registers an IPython event callback")
            elif node.attr == "modules" and _is_sys(node.value, aliases) \
                    and _changes_sys_modules(node, parents.get(node)):
                add("patched-module", "changes or rebinds sys.modules (where the grader's "
                                      "guard lives)")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""]
            for module in modules:
                top = module.split(".")[0]
                if top in SUSPECT_MODULES:
                    add(SUSPECT_MODULES[top], f"imports {module}")
            if isinstance(node, ast.ImportFrom) and node.module == "sys" \
                    and any(a.name == "modules" for a in node.names):
                add("patched-module", "imports sys.modules (where the grader's guard lives)")
            for a in node.names if isinstance(node, ast.ImportFrom) else ():
                bound = a.asname or a.name
                if bound in protected and not (node.module == "tinygpt.testing"
                                               and a.name == bound):
                    add("patched-checks", f"rebinds {bound} by importing {a.name} from "
                                          f"{node.module}")    # importing a check is no patch
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tinygpt"):
                for a in node.names:
                    bound = a.asname or a.name
                    if (node.module, a.name) in permitted:
                        continue
                    if bound in exercise_names or answer and a.name in exercise_names:
                        add("reference-copy", f"imports tinygpt's finished {a.name} from "
                                              f"{node.module}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in DYNAMIC_CALLS:
                add("dynamic-code", f"calls {func.id}()")
            if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
                root = _root_name(node.args[0])
                if root in aliases:
                    add("patched-module", f"{func.id} on {_dotted(node.args[0])}")
            if isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__"):
                add("patched-module", f"calls {_dotted(func)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and NOTEBOOK_FILE.search(node.value):
            add("reads-tests", f"refers to {node.value[:40]!r}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and GUARD_NAME in node.value:
            add("guard-tampering", f"names the grader's guard (a string with {GUARD_NAME!r})")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name in COMPARISON_DUNDERS:
                add("comparison-override", f"defines {node.name}")
            if node.name in protected:
                add("patched-checks", f"redefines {node.name}")
        elif isinstance(node, ast.ClassDef) and node.name in protected:
            add("patched-checks", f"redefines {node.name}")
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else \
                [node.target]
            flat = []
            for target in targets:
                flat += list(target.elts) if isinstance(target, ast.Tuple | ast.List) \
                    else [target]
            for target in flat:
                if isinstance(target, ast.Name) and target.id in protected:
                    add("patched-checks", f"rebinds {target.id}")
                elif isinstance(target, ast.Attribute | ast.Subscript):
                    root = _root_name(target)
                    if root in aliases or root in protected:
                        add("patched-module", f"assigns {_dotted(target)}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
                root = _root_name(node.value)
                names = {t.id for t in flat if isinstance(t, ast.Name)}
                if root in aliases and aliases[root].startswith("tinygpt") \
                        and node.value.attr in exercise_names & names:
                    add("reference-copy", f"binds {_dotted(node.value)}, tinygpt's finished "
                                          f"version")
    return found


def exercise_function_names(release) -> set[str]:
    """Names the answer cells define (def NAME / class NAME in the released stubs)."""
    names = set()
    for cell in release.cells:
        if cell.cell_type == "code" and is_answer(cell):
            for match in re.finditer(r"^(?:def|class)\s+([A-Za-z_]\w*)", cell.source, re.M):
                names.add(match.group(1))
    return names


def test_cell_functions(release) -> set[str]:
    """Functions and classes the released test cells define at their top level (the visible
    tests' references and helpers) and no other released cell defines."""
    def defined(cells) -> set[str]:
        names = set()
        for cell in cells:
            tree, _ = _parse(cell.source)
            if tree is None:
                continue
            names |= {node.name for node in tree.body if isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
        return names

    code = [c for c in release.cells if c.cell_type == "code"]
    return defined(c for c in code if is_test(c)) - defined(c for c in code if not is_test(c))


def _uses(source: str, names: set[str]) -> list[str]:
    """The names of `names` that `source` reads, in order of first use."""
    tree, _ = _parse(source)
    if tree is None:
        return []
    return list(dict.fromkeys(node.id for node in ast.walk(tree) if isinstance(node, ast.Name)
                              and isinstance(node.ctx, ast.Load) and node.id in names))


def _reaching(references: dict[str, str], sources: list[str]) -> dict[str, str]:
    """Every name that reaches one of `references` (name -> what it is: "which a test cell
    defines"): each reference (-> "name, which ..."), and each function or class the `sources`
    define whose body reads one of them (-> the chain it reaches it by, "helper, which calls
    kv_truth, which ..."), to any depth."""
    defined = {}
    for source in sources:
        tree, _ = _parse(source)
        if tree is None:
            continue
        defined.update({node.name: node for node in tree.body if isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)})
    chain = {name: f"{name}, {what}" for name, what in references.items()}
    grown = True
    while grown:
        grown = False
        for name, node in defined.items():
            if name in chain:
                continue
            used = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                    and isinstance(n.ctx, ast.Load) and n.id in chain]
            if used:
                chain[name], grown = f"{name}, which calls {chain[used[0]]}", True
    return chain


def finished_imports(source: str, exercise_names: set[str]) -> dict[str, str]:
    """name -> "which is tinygpt's finished X" for each name `source` binds by importing
    tinygpt's finished version of an exercise function X (`from tinygpt.sampling import
    top_k_filter as finished_top_k`)."""
    tree, _ = _parse(source)
    return {a.asname or a.name: f"which is tinygpt's finished {a.name} ({node.module})"
            for node in (ast.walk(tree) if tree is not None else ())
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tinygpt")
            for a in node.names if a.name in exercise_names}


# Imports of tinygpt's finished functions an exercise explicitly allows: answer grade_id ->
# (module, name) pairs. Day 04, exercise 6 (grouped_query_attention): "If an earlier exercise
# of yours is not passing yet, you may call tinygpt.attention.repeat_kv and
# tinygpt.attention.scaled_dot_product_attention instead."
PERMITTED_IMPORTS: dict[str, frozenset[tuple[str, str]]] = {
    "gqa": frozenset({("tinygpt.attention", "repeat_kv"),
                      ("tinygpt.attention", "scaled_dot_product_attention")}),
}


def _code_sources(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def scan_submission(release, submission, source=None) -> list[Evidence]:
    """Static evidence from every code cell of `submission` that is not a test cell and not
    identical to a code cell of the released notebook or of the instructor's `source`
    notebook (a test cell that lost its metadata, hidden tests included): what the student
    wrote or edited. An answer cell that reaches a function a test cell defines, or tinygpt's
    finished version of an exercise that another cell imported under a name of its own,
    directly or through functions the student wrote, is a reference copy; other cells may
    call those functions (a student comparing their work with a reference is exploring)."""
    release_sources = _code_sources(release)
    original = {s.strip() for s in release_sources + (_code_sources(source) if source else [])}
    aliases = module_aliases(release_sources + _code_sources(submission))
    protected = check_names(release_sources) | {a for a, m in aliases.items()
                                                if m in ("numpy", "torch", "math")}
    names = exercise_function_names(release)
    edited = [(index, cell) for index, cell in enumerate(submission.cells)
              if cell.cell_type == "code" and not is_test(cell)
              and cell.source.strip() not in original]
    references = {name: "which a test cell defines (the tests' own)"
                  for name in test_cell_functions(release)}
    for _, cell in edited:
        if not is_answer(cell):
            references.update(finished_imports(cell.source, names))
    reaching = _reaching(references, [cell.source for _, cell in edited])
    evidence = []
    for index, cell in edited:
        grade_id = nbgrader_meta(cell).get("grade_id")
        where = grade_id if isinstance(grade_id, str) and grade_id else f"cell {index}"
        for kind, detail in scan_source(
                cell.source, aliases=aliases, protected=protected, exercise_names=names,
                answer=is_answer(cell), permitted=PERMITTED_IMPORTS.get(grade_id, frozenset())
                if is_answer(cell) and isinstance(grade_id, str) else frozenset()):
            evidence.append(Evidence(kind, where, detail))
        for name in _uses(cell.source, set(reaching)) if is_answer(cell) else ():
            evidence.append(Evidence("reference-copy", where, f"calls {reaching[name]}"))
    return evidence

