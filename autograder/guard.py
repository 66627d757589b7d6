"""The runtime half of grading integrity (the static half is autograder/integrity.py): a guard
installed in the student's kernel before any student code runs.

It records the state the tests rely on (IPython's transformers, event callbacks and cell
machinery, tracing hooks, builtins, the check and comparison functions of numpy, torch, math
and tinygpt.testing, the notebook's names for them). Before every test cell the grader asks it,
through the kernel's user_expressions channel (evaluated without input transformers or cell
hooks), to compare and restore that state; whatever was changed is put back and becomes
evidence. Each answer is signed (HMAC) with a key that only the install cell carried (its source
leaves the kernel's linecache at once) over a fresh challenge per check, so code that replaced
the guard, or replays an earlier answer, cannot produce a clean one: that is evidence too
("guard-blocked"). After every test cell the guard drops the test's source from the kernel's
linecache, so no later cell can read a hidden test from there.
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import re
import secrets
from dataclasses import asdict, dataclass

from autograder.integrity import (
    PERMITTED_IMPORTS,
    Evidence,
    _code_sources,
    exercise_function_names,
)
from autograder.notebooks import nbgrader_meta


@dataclass(frozen=True)
class GuardSpec:
    """What the in-kernel guard watches: modules to snapshot (imported at install, before any
    student code), and the exercise function names (a tinygpt object under such a name at
    test time is the package's finished version)."""

    modules: tuple[str, ...]
    exercise_names: tuple[str, ...]
    nonce: str    # the key the guard signs its answers with (never sent back)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GuardSpec:
        data = json.loads(text)
        return cls(tuple(data["modules"]), tuple(data["exercise_names"]), data["nonce"])


BASE_MODULES = ("math", "numpy", "numpy.testing", "tinygpt.testing")
TORCH_MODULES = ("torch", "torch.testing", "torch.nn.functional")


def guard_spec(release) -> GuardSpec:
    """The guard for a day's released notebook (torch watched when the notebook imports it).
    An exercise function some answer may import finished (PERMITTED_IMPORTS) is not watched:
    the static scan still flags any other cell that imports it under its own name."""
    uses_torch = any(re.search(r"^\s*(import|from)\s+torch\b", s, re.M)
                     for s in _code_sources(release))
    modules = BASE_MODULES + (TORCH_MODULES if uses_torch else ())
    grade_ids = {nbgrader_meta(c).get("grade_id") for c in release.cells}
    allowed = {name for grade_id, pairs in PERMITTED_IMPORTS.items() if grade_id in grade_ids
               for _, name in pairs}
    return GuardSpec(modules, tuple(sorted(exercise_function_names(release) - allowed)),
                     secrets.token_hex(8))


# The guard runs inside the student's kernel. It is installed as the first cell (no student
# code has run), and `check()` is evaluated as a user expression before every test cell.
GUARD_SOURCE = r'''
def _tinygpt_guard_install(spec):
    import builtins, hashlib, hmac, importlib, json, linecache, sys, types
    shell = get_ipython()
    cells = shell.compile._filename_map    # the names IPython caches cells' source under
    lines = linecache.cache
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

    def forget():
        # the cell that just ran (a test cell) leaves linecache, so no later cell reads it
        if cells:
            lines.pop(next(reversed(cells)), None)

    def check(challenge):
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
        if sys.modules.get("_tinygpt_guard") is not guard:
            note("patched-module", "replaced the grader's guard in sys.modules")
            sys.modules["_tinygpt_guard"] = guard
        if linecache.cache is not lines:
            note("reads-tests", "replaced linecache.cache")
            linecache.cache = lines
        text = json.dumps(ev)
        proof = hmac.new(secret, f"{challenge}:{text}".encode(), hashlib.sha256).hexdigest()
        return json.dumps({"proof": proof, "evidence": ev})

    secret = spec["nonce"].encode()
    guard = types.SimpleNamespace(check=check, forget=forget)
    sys.modules["_tinygpt_guard"] = guard
    forget()    # this cell's source holds the key


_tinygpt_guard_install(SPEC)
del _tinygpt_guard_install
'''

GUARD_FORGET = "__import__('sys').modules['_tinygpt_guard'].forget()"


def guard_challenge() -> str:
    """A fresh challenge for one guard check (its answer must be signed with it)."""
    return secrets.token_hex(8)


def guard_expression(challenge: str) -> str:
    """The user expression that runs one guard check, answering `challenge`."""
    return f"__import__('sys').modules['_tinygpt_guard'].check({challenge!r})"


def guard_install_code(spec: GuardSpec) -> str:
    """The cell that installs the guard (run first, before any student code)."""
    return GUARD_SOURCE.replace("SPEC", repr(asdict(spec)), 1)


def read_guard_reply(spec: GuardSpec, reply: dict | None, where: str,
                     challenge: str) -> list[Evidence]:
    """Evidence from one guard check: its findings, or the fact that the check was blocked
    (no reply, an error, or an answer not signed with this run's key for this `challenge`:
    the key never leaves the kernel's guard, so code that replaced the guard cannot sign)."""
    if not reply or reply.get("status") != "ok":
        return [Evidence("guard-blocked", where, "the grader's integrity check could not run "
                                                 "(the kernel refused or failed it)")]
    value = reply.get("data", {}).get("text/plain", "")
    try:
        data = json.loads(ast.literal_eval(value))
        evidence = data["evidence"]
        expected = hmac.new(spec.nonce.encode(), f"{challenge}:{json.dumps(evidence)}".encode(),
                            hashlib.sha256).hexdigest()
        if hmac.compare_digest(str(data["proof"]), expected):
            return [Evidence(str(kind), where, str(detail)) for kind, detail in evidence]
    except (ValueError, SyntaxError, TypeError, KeyError, RecursionError, MemoryError):
        pass
    return [Evidence("guard-blocked", where, "the grader's integrity check returned a forged "
                                             "or garbled answer")]
