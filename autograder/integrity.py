"""Grading integrity: submissions that try to fake their grade are caught or flagged.

Student code shares the kernel with the test cells, so it can make tests pass without solving
anything: rebind a check function, patch `numpy.allclose`, install an IPython input transformer
or event hook that blanks or rewrites the next cell, swallow the test's exception, put the
package's finished function in place of its own, or read the tests. Stock nbgrader notices none
of it. Two defences, both cheap:

Prevention (runtime, `GUARD_SOURCE`): before any student code runs, the grader installs a guard
in the kernel that records the state the tests rely on: IPython's input and AST transformers,
its event callbacks, the shell and kernel methods that run a cell and show its errors, the
tracing hooks, `builtins`, the comparison and check functions of numpy, torch, math and
`tinygpt.testing`, and the notebook's names for them. Before every test cell the grader asks the
guard, through the kernel's `user_expressions` channel (evaluated without input transformers or
cell hooks), to compare and restore that state. Whatever was changed is put back, so the test
runs as written, and the change becomes evidence.

Detection (static, `scan_submission`): every code cell the student wrote or edited is parsed
and searched for the means of tampering: IPython internals, frame and tracing tricks, dynamic
code (exec, eval, __import__), assignments to attributes of imported modules, rebinding the
check functions, comparison overrides (__eq__ that can say yes to anything), reading notebook
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
import json
import re
import secrets
from dataclasses import asdict, dataclass

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
               "f_code", "tb_frame", "gi_frame"}
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


def _nodes(sources: list[str]):
    """Every AST node of every source that parses (magics blanked)."""
    for source in sources:
        try:
            tree = ast.parse(_strip_magics(source))
        except SyntaxError:
            continue
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


def scan_source(source: str, *, aliases: dict[str, str], protected: set[str],
                exercise_names: set[str]) -> list[tuple[str, str]]:
    """(kind, detail) for every means of tampering found in one cell's source.

    aliases: the notebook's module aliases (module_aliases); protected: names the tests rely
    on (check functions, module aliases); exercise_names: the functions under test.
    """
    try:
        tree = ast.parse(_strip_magics(source))
    except SyntaxError:
        return []      # a syntax error fails on its own; nothing runs
    found: list[tuple[str, str]] = []

    def add(kind: str, detail: str) -> None:
        if (kind, detail) not in found:
            found.append((kind, detail))

    for node in ast.walk(tree):
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
            elif node.attr == "register" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "events":
                add("ipython-hooks", "registers an IPython event callback")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""]
            for module in modules:
                top = module.split(".")[0]
                if top in SUSPECT_MODULES:
                    add(SUSPECT_MODULES[top], f"imports {module}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tinygpt"):
                for a in node.names:
                    if a.name in exercise_names or (a.asname or a.name) in exercise_names:
                        add("reference-copy", f"imports tinygpt's finished {a.name} from "
                                              f"{node.module}")
                    if node.module == "tinygpt.testing":
                        add("patched-checks", f"re-imports {a.name} from tinygpt.testing")
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
            try:
                tree = ast.parse(_strip_magics(cell.source))
            except SyntaxError:
                continue
            names |= {node.name for node in tree.body if isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
        return names

    code = [c for c in release.cells if c.cell_type == "code"]
    return defined(c for c in code if is_test(c)) - defined(c for c in code if not is_test(c))


def _uses(source: str, names: set[str]) -> list[str]:
    """The names of `names` that `source` reads, in order of first use."""
    try:
        tree = ast.parse(_strip_magics(source))
    except SyntaxError:
        return []
    return list(dict.fromkeys(node.id for node in ast.walk(tree) if isinstance(node, ast.Name)
                              and isinstance(node.ctx, ast.Load) and node.id in names))


def _reaching(references: set[str], sources: list[str]) -> dict[str, str]:
    """Every name that reaches a test cell's function: each of `references` (-> itself), and
    each function or class the `sources` define whose body reads one of them (-> the chain
    it reaches it by, "helper, which calls kv_truth"), to any depth."""
    defined = {}
    for source in sources:
        try:
            tree = ast.parse(_strip_magics(source))
        except SyntaxError:
            continue
        defined.update({node.name: node for node in tree.body if isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)})
    chain = {name: name for name in references}
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


def _code_sources(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def scan_submission(release, submission, source=None) -> list[Evidence]:
    """Static evidence from every code cell of `submission` that is not a test cell and not
    identical to a code cell of the released notebook or of the instructor's `source`
    notebook (a test cell that lost its metadata, hidden tests included): what the student
    wrote or edited. An answer cell that reaches a function a test cell defines, directly or
    through functions the student wrote, is a reference copy; other cells may call those
    functions (a student comparing their work with the test's reference is exploring)."""
    release_sources = _code_sources(release)
    original = {s.strip() for s in release_sources + (_code_sources(source) if source else [])}
    aliases = module_aliases(release_sources + _code_sources(submission))
    protected = check_names(release_sources) | {a for a, m in aliases.items()
                                                if m in ("numpy", "torch", "math")}
    names = exercise_function_names(release)
    edited = [(index, cell) for index, cell in enumerate(submission.cells)
              if cell.cell_type == "code" and not is_test(cell)
              and cell.source.strip() not in original]
    reaching = _reaching(test_cell_functions(release), [cell.source for _, cell in edited])
    evidence = []
    for index, cell in edited:
        where = nbgrader_meta(cell).get("grade_id") or f"cell {index}"
        for kind, detail in scan_source(cell.source, aliases=aliases, protected=protected,
                                        exercise_names=names):
            evidence.append(Evidence(kind, where, detail))
        for name in _uses(cell.source, set(reaching)) if is_answer(cell) else ():
            evidence.append(Evidence("reference-copy", where, f"calls {reaching[name]}, which "
                                                              f"a test cell defines (the tests' "
                                                              f"own)"))
    return evidence


# --------------------------------------------------------------------------------------------
# the runtime guard


@dataclass(frozen=True)
class GuardSpec:
    """What the in-kernel guard watches: modules to snapshot (imported at install, before any
    student code), and the exercise function names (a tinygpt object under such a name at
    test time is the package's finished version)."""

    modules: tuple[str, ...]
    exercise_names: tuple[str, ...]
    nonce: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GuardSpec:
        data = json.loads(text)
        return cls(tuple(data["modules"]), tuple(data["exercise_names"]), data["nonce"])


BASE_MODULES = ("math", "numpy", "numpy.testing", "tinygpt.testing")
TORCH_MODULES = ("torch", "torch.testing", "torch.nn.functional")


def guard_spec(release) -> GuardSpec:
    """The guard for a day's released notebook (torch watched when the notebook imports it)."""
    uses_torch = any(re.search(r"^\s*(import|from)\s+torch\b", s, re.M)
                     for s in _code_sources(release))
    modules = BASE_MODULES + (TORCH_MODULES if uses_torch else ())
    return GuardSpec(modules, tuple(sorted(exercise_function_names(release))),
                     secrets.token_hex(8))


# The guard runs inside the student's kernel. It is installed as the first cell (no student
# code has run), and `check()` is evaluated as a user expression before every test cell.
GUARD_SOURCE = r'''
def _tinygpt_guard_install(spec):
    import builtins, importlib, json, sys, types
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    missing = object()
    mods = {}
    for name in spec["modules"]:
        try:
            mods[name] = importlib.import_module(name)
        except Exception:
            pass
    snap = {name: {k: v for k, v in vars(m).items() if callable(v) or isinstance(v, type)}
            for name, m in mods.items()}
    tensor = getattr(mods.get("torch"), "Tensor", None)
    tensor_snap = dict(vars(tensor)) if tensor is not None else {}
    builtin_snap = dict(vars(builtins))
    tm = shell.input_transformer_manager
    list_owners = [(shell, "input_transformers_post"), (shell, "ast_transformers"),
                   (tm, "cleanup_transforms"), (tm, "line_transforms"),
                   (tm, "token_transformers")]
    lists = {(id(o), a): (o, a, getattr(o, a), list(getattr(o, a))) for o, a in list_owners}
    events = {k: list(v) for k, v in shell.events.callbacks.items()}
    benign = ("matplotlib", "matplotlib_inline", "ipykernel", "IPython", "ipywidgets",
              "comm", "traitlets")
    # names IPython and ipykernel swap in and out around every cell (the guard's snapshot is
    # taken inside a cell, its checks run outside one)
    trap_names = {"_", "__", "___", "exit", "quit", "get_ipython", "display", "__IPYTHON__",
                  "input", "raw_input", "getpass"}
    shell_names = ("showtraceback", "_showtraceback", "showsyntaxerror", "run_cell",
                   "run_cell_async", "transform_cell", "run_ast_nodes", "run_code",
                   "user_expressions", "custom_exceptions", "CustomTB", "InteractiveTB",
                   "SyntaxTB", "should_run_async", "_run_cell", "ex")
    kernel_names = ("do_execute", "execute_request", "send_response")
    objs = [(shell, shell_names)] + ([(kernel, kernel_names)] if kernel is not None else [])
    inst = {(id(o), n): o.__dict__.get(n, missing) for o, names in objs for n in names}
    cls = {(c, n): c.__dict__.get(n, missing) for o, names in objs
           for c in type(o).__mro__ for n in names}
    trace = (sys.gettrace(), sys.getprofile())
    aliases = {"np": "numpy", "numpy": "numpy", "torch": "torch", "math": "math"}
    checks = {k: v for k, v in snap.get("tinygpt.testing", {}).items()
              if not k.startswith("_")}

    import site, sysconfig
    lib_dirs = tuple({sys.prefix, sys.base_prefix, sysconfig.get_paths()["purelib"],
                      *site.getsitepackages()})

    def library_wrapper(new, old):
        # torch wraps some of its own functions when a submodule loads (torch._dynamo wraps
        # torch.manual_seed): a wrapper defined in an installed library around the original
        w = new
        for _ in range(8):
            code = getattr(w, "__code__", None)
            inner = getattr(w, "__wrapped__", None)
            if code is None or inner is None or not code.co_filename.startswith(lib_dirs):
                return False
            if inner is old:
                return True
            w = inner
        return False

    def check():
        ev = []
        def note(kind, detail):
            if [kind, detail] not in ev:
                ev.append([kind, detail])
        for key, (owner, attr, obj, items) in lists.items():
            if getattr(owner, attr) is not obj:
                note("ipython-hooks", f"replaced IPython's {attr}")
                setattr(owner, attr, obj)
            if list(obj) != items:
                note("ipython-hooks", f"changed IPython's {attr}")
                obj[:] = items
        for name, cbs in list(shell.events.callbacks.items()):
            before = events.get(name, [])
            added = [cb for cb in cbs if cb not in before and not (
                getattr(cb, "__module__", None) or "").startswith(benign)]
            if added or any(cb not in cbs for cb in before):
                note("ipython-hooks", f"registered or removed a {name} event callback")
                cbs[:] = [cb for cb in cbs if cb not in added] + [
                    cb for cb in before if cb not in cbs]
        for o, names in objs:
            for n in names:
                if o.__dict__.get(n, missing) is not inst[(id(o), n)]:
                    note("ipython-hooks", f"replaced {type(o).__name__}.{n} on the instance")
                    if inst[(id(o), n)] is missing:
                        o.__dict__.pop(n, None)
                    else:
                        o.__dict__[n] = inst[(id(o), n)]
        for (c, n), v in cls.items():
            if c.__dict__.get(n, missing) is not v:
                note("ipython-hooks", f"patched {c.__name__}.{n}")
                if v is missing:
                    delattr(c, n)
                else:
                    setattr(c, n, v)
        if (sys.gettrace(), sys.getprofile()) != trace:
            note("introspection", "installed a trace or profile hook")
            sys.settrace(trace[0]); sys.setprofile(trace[1])
        current = vars(builtins)
        for k, v in builtin_snap.items():
            if current.get(k, missing) is not v and k not in trap_names:
                note("patched-builtins", f"replaced builtins.{k}")
                current[k] = v
        for name, m in mods.items():
            if sys.modules.get(name) is not m:
                note("patched-module", f"replaced the module {name} in sys.modules")
                sys.modules[name] = m
            for k, v in snap[name].items():
                now = vars(m).get(k, missing)
                if now is not v:
                    if library_wrapper(now, v):
                        snap[name][k] = now
                        continue
                    note("patched-module", f"replaced {name}.{k}")
                    setattr(m, k, v)
        if tensor is not None:
            for k, v in tensor_snap.items():
                if tensor.__dict__.get(k, missing) is not v:
                    note("patched-module", f"replaced torch.Tensor.{k}")
                    setattr(tensor, k, v)
        ns = shell.user_ns
        for k, v in checks.items():
            if k in ns and ns[k] is not v:
                note("patched-checks", f"rebound {k}")
                ns[k] = v
        for alias, name in aliases.items():
            if alias in ns and name in mods and ns[alias] is not mods[name]:
                note("patched-checks", f"rebound {alias} (it must be the {name} module)")
                ns[alias] = mods[name]
        for name in spec["exercise_names"]:
            mod = getattr(ns.get(name), "__module__", None) or ""
            if mod.startswith("tinygpt."):
                note("reference-copy", f"{name} is tinygpt's finished version ({mod})")
        return json.dumps({"nonce": spec["nonce"], "evidence": ev})

    sys.modules["_tinygpt_guard"] = types.SimpleNamespace(check=check)


_tinygpt_guard_install(SPEC)
del _tinygpt_guard_install
'''

GUARD_EXPRESSION = "__import__('sys').modules['_tinygpt_guard'].check()"


def guard_install_code(spec: GuardSpec) -> str:
    """The cell that installs the guard (run first, before any student code)."""
    return GUARD_SOURCE.replace("SPEC", repr(asdict(spec)), 1)


def read_guard_reply(spec: GuardSpec, reply: dict | None, where: str) -> list[Evidence]:
    """Evidence from one guard check: its findings, or the fact that the check was blocked
    (no reply, an error, or an answer without this run's nonce)."""
    if not reply or reply.get("status") != "ok":
        return [Evidence("guard-blocked", where, "the grader's integrity check could not run "
                                                 "(the kernel refused or failed it)")]
    value = reply.get("data", {}).get("text/plain", "")
    try:
        data = json.loads(ast.literal_eval(value))
    except (ValueError, SyntaxError, TypeError):
        data = None
    if not isinstance(data, dict) or data.get("nonce") != spec.nonce:
        return [Evidence("guard-blocked", where, "the grader's integrity check returned a "
                                                 "forged or garbled answer")]
    return [Evidence(kind, where, detail) for kind, detail in data.get("evidence", [])]
