"""Mutation testing of the graded exercises: do the tests catch every small slip?

A *mutant* is the solution's answer cell with one small change of the kind students make: a
comparison or boundary flip (`<` and `<=`, `>` and `>=`, `==` and `!=`), an integer constant or
a slice bound off by one, a swapped arithmetic operator (`+` and `-`, `*` and `/`), a flipped or
dropped keyword argument (`dim=-1` to `dim=0`, `keepdim=True` to `False`, `descending`, a
dropped `generator=`), `and` for `or`, a dropped `not`, a removed `raise` or an `if` guard that
never fires. Each mutant replaces its answer cell and is graded by the in-kernel grader
(autograder/kernel.py): one Jupyter kernel per day walks the solution notebook and, at each
test cell, runs the test once per mutant. A mutant is *killed* when its exercise loses points;
one that keeps them is a *survivor*: either the tests are too weak or the mutant is equivalent
(it computes the same thing, e.g. `<` for `<=` on values that can never be equal). Equivalent
mutants are listed with a reason in the day's mistakes module, `EQUIVALENT_MUTANTS`.

    python -m autograder mutants day07_sampling      # or: make mutants DAY=day07_sampling

Only the student's part of an answer cell (between ### BEGIN SOLUTION and ### END SOLUTION) is
mutated; the text of error messages, docstrings and print calls is left alone.

Why a small `ast` mutator rather than mutmut or cosmic-ray: both mutate Python files of an
installed project and run a test command per mutant (mutmut rewrites the source tree with
trampolines and runs pytest; cosmic-ray records a session for module paths and runs a test
command per job). Notebook answer cells are code strings graded inside a running kernel; feeding
them to those tools would mean writing each cell to a module and starting a kernel (seconds)
per mutant, where the in-kernel grader needs one kernel per day.
"""

from __future__ import annotations

import ast
import difflib
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from autograder import mistakes
from autograder.kernel import CellError, Kernel, error_text, grading_env, score
from autograder.mistakes import Mistake
from autograder.notebooks import exercises, read, solution_path

SAMPLE_SEED = 17
SAMPLE_PER_DAY = 12  # mutants per day that `make test` grades (the full run is `make mutants`)

_COMPARE_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                 ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
                 ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
               ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult,
               ast.MatMult: ast.Mult}
_OP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
            ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in", ast.Is: "is",
            ast.IsNot: "is not", ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/",
            ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**", ast.MatMult: "@"}
# Parents in which a replaced expression needs parentheses to keep its meaning.
_TIGHT_PARENTS = (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Attribute, ast.Subscript,
                  ast.Call, ast.Starred, ast.Await)
_QUIET_CALLS = {"print", "display", "warn"}


@dataclass(frozen=True)
class Mutant:
    """One single-point change of an answer cell."""

    grade_id: str  # the exercise (answer cell) it belongs to
    operator: str  # compare, number, binop, augassign, slice, range, bool, keyword, boolop,
    #                not, raise, guard
    line: int  # 1-based line of the cell where the change starts
    before: str  # that line, stripped, before the change
    after: str  # the same line after it
    code: str  # the whole mutated cell

    @property
    def key(self) -> str:
        """Stable name used by the allow-list: 'grade_id: before => after'."""
        return f"{self.grade_id}: {self.before} => {self.after}"

    def diff(self, original: str) -> str:
        return "".join(difflib.unified_diff(original.splitlines(True), self.code.splitlines(True),
                                            f"{self.grade_id} (solution)",
                                            f"{self.grade_id} (mutant)", n=1))

    def as_mistake(self) -> Mistake:
        """The mutant as a mistakes-corpus entry. Its code first forgets the names the cell
        defines, so a mutant cell that raises leaves them undefined, as it would in the fresh
        kernel nbgrader grades in (not the solution's values from the walk so far)."""
        names = sorted(_defined_names(self.code))
        forget = f"for _name in {names!r}:\n    globals().pop(_name, None)\n" if names else ""
        return Mistake(self.grade_id, f"mutant [{self.operator}] {self.before} => {self.after}",
                       forget + self.code)


def _defined_names(code: str) -> set[str]:
    """Names a cell binds at its top level (functions, classes, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(code).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _solution_lines(source: str) -> tuple[int, int]:
    """1-based line range strictly between ### BEGIN SOLUTION and ### END SOLUTION."""
    lines = source.splitlines()
    begin = next((i for i, text in enumerate(lines, 1) if "### BEGIN SOLUTION" in text), 0)
    end = next((i for i, text in enumerate(lines, 1) if "### END SOLUTION" in text),
               len(lines) + 1)
    return begin + 1, end - 1


class _Splicer:
    """Replace a (line, col)-(end_line, end_col) span of `source` (ast byte offsets)."""

    def __init__(self, source: str) -> None:
        self.lines = [line.encode() for line in source.splitlines(True)]

    def offset(self, line: int, col: int) -> int:
        return sum(len(text) for text in self.lines[:line - 1]) + col

    def text(self, node: ast.AST) -> str:
        raw = b"".join(self.lines)
        return raw[self.offset(node.lineno, node.col_offset):
                   self.offset(node.end_lineno, node.end_col_offset)].decode()

    def replace(self, start: tuple[int, int], end: tuple[int, int], new: str) -> str:
        raw = b"".join(self.lines)
        return (raw[:self.offset(*start)] + new.encode() + raw[self.offset(*end):]).decode()


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _skipped(tree: ast.AST, parents: dict) -> set[ast.AST]:
    """Nodes never mutated: f-strings, docstrings, raise arguments, print/warn calls."""
    skip: set[ast.AST] = set()
    for node in ast.walk(tree):
        quiet = (isinstance(node, ast.JoinedStr)
                 or isinstance(node, ast.Raise) and node.exc is not None
                 or isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)
                 and (getattr(node.func, "id", None) or getattr(node.func, "attr", None))
                 in _QUIET_CALLS)
        if quiet:
            inner = node.exc if isinstance(node, ast.Raise) else node
            skip.update(ast.walk(inner))
    return skip


def mutants_of(grade_id: str, source: str) -> list[Mutant]:
    """Every single-point mutant of the solution part of one answer cell, in source order."""
    tree = ast.parse(source)
    parents = _parents(tree)
    skip = _skipped(tree, parents)
    first, last = _solution_lines(source)
    splice = _Splicer(source)
    found: list[tuple[str, tuple[int, int], tuple[int, int], str]] = []

    def wrap(node: ast.AST, text: str) -> str:
        parent = parents.get(node)
        tight = isinstance(parent, _TIGHT_PARENTS) and not (
            isinstance(parent, ast.Subscript) and node is parent.slice
            or isinstance(parent, ast.Call) and node is not parent.func)
        try:
            atom = ast.parse(text, mode="eval").body
        except SyntaxError:
            atom = None
        if isinstance(atom, ast.Call | ast.Name | ast.Attribute | ast.Subscript) or (
                isinstance(atom, ast.Constant) and not isinstance(parent, ast.Attribute)):
            tight = False
        return f"({text})" if tight else text

    def span(node: ast.AST) -> tuple[tuple[int, int], tuple[int, int]]:
        return (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)

    def add(op: str, node: ast.AST, new: str) -> None:
        found.append((op, *span(node), new))

    def gap_operator(left: ast.AST, right: ast.AST, old: str, new: str, op: str) -> None:
        """Replace the operator token between two operands, leaving the rest of the text."""
        start, end = (left.end_lineno, left.end_col_offset), (right.lineno, right.col_offset)
        raw = b"".join(splice.lines)
        gap = raw[splice.offset(*start):splice.offset(*end)].decode()
        pattern = r"(?<![<>=!*/])" + re.escape(old).replace(r"\ ", r"\s+") + r"(?![<>=*/])"
        if old.isalpha() or " " in old:
            pattern = r"\b" + re.escape(old).replace(r"\ ", r"\s+") + r"\b"
        match = re.search(pattern, gap)
        if match:
            new_gap = gap[:match.start()] + new + gap[match.end():]
            found.append((op, start, end, new_gap))

    for node in ast.walk(tree):
        if node in skip or not hasattr(node, "lineno"):
            continue
        if node.lineno < first or node.end_lineno > last:
            continue
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                swap = _COMPARE_SWAP.get(type(op))
                if swap:
                    gap_operator(operands[i], operands[i + 1], _OP_TEXT[type(op)],
                                 _OP_TEXT[swap], "compare")
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:
            swap = _BINOP_SWAP[type(node.op)]
            gap_operator(node.left, node.right, _OP_TEXT[type(node.op)], _OP_TEXT[swap], "binop")
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BINOP_SWAP:
            swap = _BINOP_SWAP[type(node.op)]
            gap_operator(node.target, node.value, _OP_TEXT[type(node.op)] + "=",
                         _OP_TEXT[swap] + "=", "augassign")
        elif (isinstance(node, ast.Constant) and type(node.value) is int
              and not isinstance(parents.get(node), ast.UnaryOp)):
            for delta in (1, -1):
                add("number", node, wrap(node, str(node.value + delta)))
        elif (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
              and isinstance(node.operand, ast.Constant) and type(node.operand.value) is int):
            for delta in (1, -1):
                add("number", node, wrap(node, str(-node.operand.value + delta)))
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            add("keyword" if isinstance(parents.get(node), ast.keyword) else "bool", node,
                str(not node.value))
        elif isinstance(node, ast.Slice):
            for bound in (node.lower, node.upper):
                if bound is not None and not _is_int(bound):
                    text = splice.text(bound)
                    base = text if isinstance(bound, ast.Name | ast.Attribute | ast.Call) \
                        else f"({text})"
                    add("slice", bound, f"{base} + 1")
                    add("slice", bound, f"{base} - 1")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "range"):
            for arg in node.args:
                if not _is_int(arg):
                    text = splice.text(arg)
                    base = text if isinstance(arg, ast.Name | ast.Attribute | ast.Call) \
                        else f"({text})"
                    add("range", arg, f"{base} + 1")
                    add("range", arg, f"{base} - 1")
        elif isinstance(node, ast.BoolOp):
            other = "or" if isinstance(node.op, ast.And) else "and"
            for left, right in zip(node.values, node.values[1:], strict=False):
                gap_operator(left, right, "and" if other == "or" else "or", other, "boolop")
            for i in range(len(node.values)):
                rest = [splice.text(v) for j, v in enumerate(node.values) if j != i]
                joined = f" {'and' if isinstance(node.op, ast.And) else 'or'} ".join(rest)
                add("boolop", node, wrap(node, joined) if len(rest) > 1 else wrap(node, rest[0]))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add("not", node, wrap(node, splice.text(node.operand)))
        elif isinstance(node, ast.Raise):
            add("raise", node, "pass")
        elif isinstance(node, ast.If) and node.test not in skip:
            add("guard", node.test, "False")
        if isinstance(node, ast.Call) and node not in skip:
            for kw in node.keywords:
                if kw.arg is None:
                    continue
                reduced = ast.Call(node.func, node.args, [k for k in node.keywords if k is not kw])
                add("keyword", node, wrap(node, _unparse_call(splice, reduced)))

    mutants, seen = [], set()
    lines = source.splitlines()
    for op, start, end, new in found:
        code = splice.replace(start, end, new)
        if code == source or code in seen:
            continue
        try:
            ast.parse(code)
        except SyntaxError:
            continue
        seen.add(code)
        new_lines = code.splitlines()
        changed = next((i for i, (a, b) in enumerate(zip(lines, new_lines, strict=False))
                        if a != b), min(len(lines), len(new_lines)) - 1)
        after = new_lines[changed] if changed < len(new_lines) else ""
        mutants.append(Mutant(grade_id, op, changed + 1, lines[changed].strip(), after.strip(),
                              code))
    return mutants


def _is_int(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def _unparse_call(splice: _Splicer, call: ast.Call) -> str:
    """The call's text from its own source pieces (keeps the student's spelling)."""
    parts = [splice.text(a) for a in call.args]
    parts += [f"{k.arg}={splice.text(k.value)}" if k.arg else f"**{splice.text(k.value)}"
              for k in call.keywords]
    return f"{splice.text(call.func)}({', '.join(parts)})"


def day_mutants(day: str, root: Path | None = None) -> list[Mutant]:
    """Every mutant of every graded answer cell of the day's solution notebook."""
    nb = read(solution_path(day) if root is None else solution_path(day, root))
    found = []
    for ex in exercises(nb):
        found += mutants_of(ex.grade_id, nb.cells[ex.answer_index].source)
    return found


def allowed(day: str) -> dict[str, str]:
    """The day's equivalent mutants: key -> the reason it computes the same thing."""
    return dict(mistakes.equivalent_mutants(day))


def sample(day: str, n: int = SAMPLE_PER_DAY, seed: int = SAMPLE_SEED,
           root: Path | None = None) -> list[Mutant]:
    """A fixed, seeded sample of the day's non-equivalent mutants (what `make test` grades)."""
    skip = allowed(day)
    pool = [m for m in day_mutants(day, root) if m.key not in skip]
    rng = random.Random(f"{seed}:{day}")
    return sorted(rng.sample(pool, min(n, len(pool))), key=pool.index)


@dataclass
class Result:
    mutant: Mutant
    score: float
    max_points: float
    error: str
    seconds: float

    @property
    def killed(self) -> bool:
        return self.score < self.max_points


@dataclass
class DayReport:
    day: str
    results: list[Result] = field(default_factory=list)
    allowed: dict[str, str] = field(default_factory=dict)
    answers: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def survivors(self, *, include_allowed: bool = False) -> list[Result]:
        return [r for r in self.results if not r.killed
                and (include_allowed or r.mutant.key not in self.allowed)]

    def stale_allowed(self) -> list[str]:
        """Allow-list entries that match no mutant any more (the code changed)."""
        keys = {r.mutant.key for r in self.results}
        return sorted(k for k in self.allowed if k not in keys)

    def table(self) -> str:
        rows = [f"{'exercise':<22}{'mutants':>8}{'killed':>8}{'equiv':>7}{'survived':>9}"
                f"{'score':>8}"]
        for grade_id in dict.fromkeys(r.mutant.grade_id for r in self.results):
            mine = [r for r in self.results if r.mutant.grade_id == grade_id]
            rows.append(_row(grade_id, mine, self.allowed))
        rows.append(_row("all", self.results, self.allowed))
        return "\n".join(rows)

    def score(self) -> float:
        """Killed / (mutants - equivalent survivors), 1.0 when there are none."""
        equivalent = sum(1 for r in self.results if not r.killed and r.mutant.key in self.allowed)
        total = len(self.results) - equivalent
        return sum(r.killed for r in self.results) / total if total else 1.0


def _row(name: str, results: list[Result], allow: dict[str, str]) -> str:
    killed = sum(r.killed for r in results)
    equivalent = sum(1 for r in results if not r.killed and r.mutant.key in allow)
    survived = len(results) - killed - equivalent
    total = len(results) - equivalent
    score = f"{100 * killed / total:.0f}%" if total else "-"
    return f"{name:<22}{len(results):>8}{killed:>8}{equivalent:>7}{survived:>9}{score:>8}"


def run_day(day: str, chosen: list[Mutant] | None = None, *, min_timeout: float = 20.0,
            progress=None, root: Path | None = None) -> DayReport:
    """Grade each mutant of `day` (all, or `chosen`) with the in-kernel grader.

    The solution notebook is root's (default: this repository's); its kernel runs in grading
    mode, as the grader's does. A mutant's test run gets max(min_timeout, 20 x the correct
    test's time); a kernel that dies or hangs is restarted and the notebook replayed up to
    the exercise.
    """
    path = solution_path(day) if root is None else solution_path(day, root)
    nb = read(path)
    todo = day_mutants(day, root) if chosen is None else chosen
    report = DayReport(day, allowed=allowed(day))
    by_test = {ex.test_index: ex for ex in exercises(nb)}
    report.answers = {ex.grade_id: nb.cells[ex.answer_index].source for ex in by_test.values()}
    started = time.monotonic()
    kernel = Kernel(cwd=path.parent, env=grading_env())
    try:
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            exercise = by_test.get(index)
            if exercise is None:
                _must(kernel, cell.source, f"cell {index} of {path.name}")
                continue
            answer = nb.cells[exercise.answer_index].source
            t0 = time.monotonic()
            outputs = kernel.run(cell.source)
            base = time.monotonic() - t0
            if score(cell, outputs) != exercise.points:
                raise CellError(f"{day}: the solution fails {exercise.grade_id}: "
                                f"{error_text(outputs)}")
            limit = max(min_timeout, 20 * base)
            for mutant in (m for m in todo if m.grade_id == exercise.grade_id):
                t0 = time.monotonic()
                outputs = kernel.run(mutant.code, timeout=limit)
                if not error_text(outputs):  # a mutant cell that raises never defines anything
                    outputs = kernel.run(cell.source, timeout=limit)
                result = Result(mutant, score(cell, outputs), exercise.points,
                                error_text(outputs), time.monotonic() - t0)
                report.results.append(result)
                if progress:
                    progress(result)
                if kernel.dead:
                    kernel.close()
                    kernel = _replay(path, nb, index)
                _must(kernel, answer, f"restoring {exercise.grade_id}")
    finally:
        kernel.close()
    report.seconds = time.monotonic() - started
    return report


def _must(kernel: Kernel, code: str, what: str) -> None:
    error = error_text(kernel.run(code))
    if error:
        raise CellError(f"{what} failed: {error}")


def _replay(path: Path, nb, upto: int) -> Kernel:
    kernel = Kernel(cwd=path.parent, env=grading_env())
    for cell in nb.cells[:upto]:
        if cell.cell_type == "code":
            kernel.run(cell.source)
    return kernel


def format_report(report: DayReport, *, diffs: bool = True) -> str:
    lines = [f"== {report.day}: mutation score {100 * report.score():.1f}% "
             f"({len(report.results)} mutants, {report.seconds:.0f} s)", report.table()]
    survivors = report.survivors()
    if survivors:
        lines.append(f"\n{len(survivors)} surviving mutant(s) not on the allow-list "
                     f"(EQUIVALENT_MUTANTS in autograder/mistakes/{report.day}.py):")
        for r in survivors:
            lines.append(f"\n  key: {r.mutant.key}")
            if diffs:
                diff = r.mutant.diff(report.answers[r.mutant.grade_id])
                lines.append("    " + diff.rstrip().replace("\n", "\n    "))
    stale = report.stale_allowed()
    if stale:
        lines.append("\nallow-list entries that match no mutant (remove them): " + "; ".join(stale))
    return "\n".join(lines)


def main(days: list[str], *, root: Path | None = None, sample_size: int | None = None,
         diffs: bool = True) -> int:
    """Print each day's mutation score (of root's solutions, default: this repository's), for
    all its mutants or a sample of sample_size >= 1; exit status 1 when a non-allowed mutant
    survives."""
    if sample_size is not None and (isinstance(sample_size, bool)
                                    or not isinstance(sample_size, int) or sample_size < 1):
        raise ValueError(f"sample_size must be an int >= 1 or None (all), got {sample_size!r}")
    failed = False
    for day in days:
        chosen = None if sample_size is None else sample(day, sample_size, root=root)
        report = run_day(day, chosen, root=root)
        print(format_report(report, diffs=diffs), flush=True)
        failed |= bool(report.survivors())
    return 1 if failed else 0
