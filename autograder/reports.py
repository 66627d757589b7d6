"""What the instructor hands out after grading: a grades CSV and per-student feedback pages.

Feedback shows, for every graded cell, the points, pass or fail and the failure's message
(our checks write messages that teach), and the student's own answers. It never shows the
code of a test cell, so hidden tests stay hidden (nbgrader's own feedback prints them).
"""

from __future__ import annotations

import ast
import csv
import html
import json
import re
from collections.abc import Collection
from pathlib import Path

from autograder.grading import _api
from autograder.notebooks import is_answer, is_test, nbgrader_meta, read


def grading_record(root: Path, student: str, day: str) -> dict:
    """What `grade` recorded for one submission (status, reason, evidence), or {}."""
    from autograder.grade import RECORD_FILE

    path = root / "autograded" / student / day / RECORD_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


GRADER_LIMITS = ("timeout", "crashed", "memory-limit", "blocked", "error")


def review_note(root: Path, student: str, days: list[str]) -> str:
    """The days a student's submission needs a look: flagged for signs of tampering (with the
    evidence), or stopped by one of the grader's limits (a timeout, a crash, the memory limit:
    with what was stopped, so that it never reads as the student's mistake)."""
    notes = []
    for day in days:
        record = grading_record(root, student, day)
        if record.get("status") == "flagged" or record.get("evidence"):
            notes.append(f"{day}: {record.get('evidence') or record.get('reason', '')}")
        elif record.get("status") in GRADER_LIMITS:
            notes.append(f"{day}: {record['status']}: {record.get('reason', '')}")
    return " | ".join(notes)


def exercise_names(day: str, root: Path) -> dict[str, str]:
    """test cell grade_id -> the exercise it grades (its answer cell's grade_id), from the
    day's source notebook; self-checks keep their own names (q1, q2, ...)."""
    from autograder.notebooks import exercises, solution_path

    return {ex.test_id: ex.grade_id for ex in exercises(read(solution_path(day, root)))}


def exercise_scores(root: Path, db_url: str | None = None) -> list[tuple]:
    """(student, day, exercise, score, max_score) for every student, day and exercise of the
    gradebook; an exercise of a day the student did not submit scores 0."""
    from nbgrader.api import Gradebook, MissingEntry

    api = _api(root, db_url)
    rows = []
    with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
        days = sorted(a.name for a in gb.assignments)
        cells = {d: [(c.name, float(c.max_score)) for n in gb.find_assignment(d).notebooks
                     for c in n.grade_cells] for d in days}
        names = {d: exercise_names(d, root) for d in days}
        for student in sorted(s.id for s in gb.students):
            for day in days:
                try:
                    notebook = gb.find_submission_notebook(day, day, student)
                    got = {g.name: float(g.score) for g in notebook.grades}
                except MissingEntry:
                    got = {}
                for test_id, max_score in cells[day]:
                    rows.append((student, day, names[day].get(test_id, test_id),
                                 got.get(test_id, 0.0), max_score))
    return rows


def item_analysis(rows: list[tuple], day: str,
                  students: Collection[str] | None = None) -> list[dict]:
    """Per exercise of `day`: how many students, the mean score, the share with full marks
    (nbgrader's formgrader shows the same two numbers per question). `students`: count only
    these (those who submitted the day, graded_students): a student who did not submit scores
    0 in `rows` (exercise_scores) but says nothing about how hard an exercise is."""
    if students is not None and (isinstance(students, str)
                                 or not all(isinstance(s, str) for s in students)):
        raise TypeError(f"students must be a collection of student ids or None, got "
                        f"{students!r}")
    found: dict[str, list[tuple[float, float]]] = {}
    for student, d, exercise, score, max_score in rows:
        if d == day and (students is None or student in students):
            found.setdefault(exercise, []).append((score, max_score))
    return [{"exercise": exercise, "students": len(scores), "max_score": scores[0][1],
             "mean": sum(s for s, _ in scores) / len(scores),
             "full_marks": sum(s >= m for s, m in scores) / len(scores)}
            for exercise, scores in found.items()]


def format_item_analysis(items: list[dict], day: str, not_submitted: int = 0) -> str:
    """The item analysis as a text table, hardest exercise first; `not_submitted`: how many
    students of the gradebook did not submit the day (left out of the table), said when > 0."""
    if isinstance(not_submitted, bool) or not isinstance(not_submitted, int) \
            or not_submitted < 0:
        raise ValueError(f"not_submitted must be an int >= 0, got {not_submitted!r}")
    title = f"item analysis, {day}"
    if not_submitted:
        title += (f" ({not_submitted} student{'s' if not_submitted > 1 else ''} of the "
                  f"gradebook did not submit it: not counted)")
    lines = [title, f"{'exercise':<28}{'students':>9}{'mean':>9}{'max':>6}{'full marks':>12}"]
    for item in sorted(items, key=lambda i: (i["full_marks"], i["exercise"])):
        lines.append(f"{item['exercise']:<28}{item['students']:>9}{item['mean']:>9.2f}"
                     f"{item['max_score']:>6g}{item['full_marks']:>12.0%}")
    return "\n".join(lines)


BY_EXERCISE_FILE = "grades-by-exercise.csv"


def export_csv(path: Path, root: Path, db_url: str | None = None) -> Path:
    """One row per student, one column per day (its score, 0 when not submitted), a total,
    and a `review` column naming the days flagged for signs of tampering (with evidence) or
    stopped by a grader limit (timeout, crash, memory: with what was stopped).
    Beside it, grades-by-exercise.csv: a row per student, day and exercise."""
    from nbgrader.api import Gradebook, MissingEntry

    api = _api(root, db_url)
    with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
        days = sorted(a.name for a in gb.assignments)
        rows = []
        for student in sorted(gb.students, key=lambda s: s.id):
            scores = []
            for day in days:
                try:
                    scores.append(float(gb.find_submission(day, student.id).score))
                except MissingEntry:
                    scores.append(0.0)
            rows.append([student.id, *[f"{s:g}" for s in scores], f"{sum(scores):g}",
                         review_note(root, student.id, days)])
        maxima = [float(gb.find_assignment(d).max_score) for d in days]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *days, "total", "review"])
        writer.writerow(["(max)", *[f"{m:g}" for m in maxima], f"{sum(maxima):g}", ""])
        writer.writerows(rows)
    with open(path.parent / BY_EXERCISE_FILE, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "day", "exercise", "score", "max_score"])
        writer.writerows((st, d, ex, f"{sc:g}", f"{mx:g}")
                         for st, d, ex, sc, mx in exercise_scores(root, db_url))
    return path


def _titles(nb) -> dict[str, str]:
    """answer grade_id -> the heading of the markdown cell that introduces it."""
    titles, heading = {}, ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            found = re.findall(r"^#+\s*(.+)$", cell.source, flags=re.M)
            if found:
                heading = found[-1].strip()
            bold = re.match(r"\*\*(Q\d+\.)\*\*\s*(.*)", cell.source.strip())
            if bold:
                heading = f"{bold.group(1)} {bold.group(2).splitlines()[0]}"
        elif is_answer(cell):
            titles[nbgrader_meta(cell)["grade_id"]] = heading
    return titles


def answer_names(answer_source: str) -> list[str]:
    """The names an answer cell defines, as a student knows its exercise: its functions and
    classes (`def positions_from_mask`), or for a self-check `answer_q1` and "Q1"."""
    try:
        tree = ast.parse(answer_source)
    except SyntaxError:
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    names += [n.replace("answer_q", "Q") for n in names if n.startswith("answer_q")]
    return list(dict.fromkeys(names))


def name_the_exercise(message: str, names: list[str]) -> str:
    """`message` (a failed check or an exception) as the feedback shows it: led by the name
    of the exercise it belongs to when it does not already name it, so that a message such as
    "2 free blocks, 9 pending tokens: expected False" says it is about `can_admit`."""
    if not names or not message or any(re.search(rf"\b{re.escape(n)}\b", message)
                                       for n in names):
        return message
    return f"{names[0]}: {message}"


ANSI = re.compile(r"\x1b\[[0-9;]*m")
CELL_FRAME = re.compile(r"Cell In\[\d+\], line (\d+)(?:, in (\w+))?")


def _constant(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def explain_error(test_source: str, error: dict) -> str:
    """The feedback for a test cell whose check did not fail but whose call raised: the
    exception, what the test was checking when it happened (the check's own description of
    the call, or the call to the student's function) and the check's hint. Never more of the
    test's code than that one call."""
    ename, evalue = error.get("ename", "Error"), str(error.get("evalue", ""))
    message = f"{ename}: {evalue}"
    if ename == "NotImplementedError":
        return message + "\nThis exercise is not answered yet: replace `raise " \
                         "NotImplementedError()` with your code."
    frames = [CELL_FRAME.search(ANSI.sub("", line)) for line in error.get("traceback", [])]
    frames = [f for f in frames if f]
    if not frames:
        return message
    line, inner = int(frames[0].group(1)), (frames[1].group(2) if len(frames) > 1 else None)
    try:
        tree = ast.parse(test_source)
    except SyntaxError:
        return message
    statement = next((n for n in tree.body if n.lineno <= line <= (n.end_lineno or n.lineno)),
                     None)
    if statement is None:
        return message
    checks = [n for n in ast.walk(statement) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Name) and n.func.id.startswith("check_")]
    what = next((w for c in checks for w in [_constant(c.args[0]) if c.args else None] if w),
                None)
    if what is None and inner:
        call = next((n for n in ast.walk(statement) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Name) and n.func.id == inner), None)
        if call is not None:
            what = ast.unparse(call)
            what = what if len(what) <= 160 else what[:157] + "..."
    later = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id.startswith("check_")
             and n.lineno >= statement.lineno]
    hint = next((h for c in checks + later for k in c.keywords if k.arg == "hint"
                 for h in [_constant(k.value)] if h), None)
    if what:
        message += f"\nYour code raised this while the test was checking: {what}"
    if hint:
        message += f"\nHint: {hint}"
    return message


MAX_MESSAGE_CHARS = 2_000   # of one failure's message on a feedback page


def feedback_html(day: str, student: str, notebook, grades: dict[str, tuple[float, float]],
                  evidence: str = "", limit_note: str = "") -> str:
    """An HTML page for one student's graded notebook (no test-cell code; a failure's message
    cut to MAX_MESSAGE_CHARS, saying so); `evidence`: why
    the submission was flagged for review, shown at the top; `limit_note`: a grader limit
    that stopped the run (a timeout, a crash), shown at the top as what it is."""
    titles, answer, parts = _titles(notebook), None, []
    total = sum(s for s, _ in grades.values())
    maximum = sum(m for _, m in grades.values())
    for cell in notebook.cells:
        if is_answer(cell):
            answer = cell
        elif is_test(cell):
            grade_id = nbgrader_meta(cell)["grade_id"]
            score, max_score = grades.get(grade_id, (0.0, float(nbgrader_meta(cell)["points"])))
            errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            passed = score >= max_score
            message = ""
            if errors and errors[-1].get("ename") == "CheckFailed":
                message = f"{errors[-1].get('ename')}: {errors[-1].get('evalue')}"
            elif errors:    # the student's code raised before a check could judge it
                message = explain_error(cell.source, errors[-1])
            if answer is not None:
                message = name_the_exercise(message, answer_names(answer.source))
            if len(message) > MAX_MESSAGE_CHARS:  # the student's own text: it could carry
                message = message[:MAX_MESSAGE_CHARS] + (  # anything the kernel held
                    f"\n[{len(message) - MAX_MESSAGE_CHARS} more characters cut]")
            name = nbgrader_meta(answer)["grade_id"] if answer is not None else grade_id
            parts.append(
                f'<section class="{"pass" if passed else "fail"}">'
                f"<h2>{html.escape(titles.get(name, name))}</h2>"
                f"<p><b>{score:g} / {max_score:g}</b> &mdash; "
                f"{'passed' if passed else 'failed'}</p>"
                + (f"<pre class='msg'>{html.escape(message)}</pre>" if message else "")
                + (f"<details><summary>your answer</summary><pre>"
                   f"{html.escape(answer.source)}</pre></details>" if answer is not None else "")
                + "</section>")
            answer = None
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}"
             "section{border-left:6px solid;padding:.2em 1em;margin:1em 0}"
             ".pass{border-color:#2a2}.fail{border-color:#c22}"
             "pre{background:#f4f4f4;padding:.5em;white-space:pre-wrap}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(day)} "
            f"feedback for {html.escape(student)}</title><style>{style}</style></head><body>"
            f"<h1>{html.escape(day)}: {total:g} / {maximum:g}</h1>"
            f"<p>Feedback for {html.escape(student)}. Each graded cell shows its points and, "
            f"when it failed, the message of the check that failed.</p>"
            + (f"<section class='fail'><h2>Flagged for review</h2><p>The grader found signs "
               f"that this submission changed how it is tested; an instructor will look at it."
               f"</p><pre class='msg'>{html.escape(evidence)}</pre></section>" if evidence
               else "")
            + (f"<section class='fail'><h2>Stopped by the grader</h2><p>The grader stopped "
               f"this run at one of its limits (time, memory, a crashed kernel). That is not a "
               f"mistake in your answers; errors of later cells that follow from it are folded "
               f"into it. An instructor will look at it.</p><pre class='msg'>"
               f"{html.escape(limit_note)}</pre></section>" if limit_note else "")
            + "".join(parts) + "</body></html>")


def submitted_work(root: Path, student: str, day: str) -> bool:
    """Whether `student` handed something in for `day`: `grade` records everyone of the
    gradebook, and those without a submission with the status `missing`."""
    return grading_record(root, student, day).get("status") != "missing"


def graded_students(day: str, root: Path, db_url: str | None = None) -> list[str]:
    """The students write_feedback writes for: those with a submission of `day` in the
    gradebook, its graded notebook in autograded/, and something handed in (not `missing`:
    a page of the release's stubs as "your answer" would be untrue)."""
    from nbgrader.api import Gradebook, MissingEntry

    api = _api(root, db_url)
    found = []
    with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
        for student in sorted(s.id for s in gb.students):
            try:
                gb.find_submission_notebook(day, day, student)
            except MissingEntry:
                continue
            if (root / "autograded" / student / day / f"{day}.ipynb").exists() \
                    and submitted_work(root, student, day):
                found.append(student)
    return found


def gradebook_students(root: Path, db_url: str | None = None) -> list[str]:
    """Every student id in the gradebook."""
    from nbgrader.api import Gradebook

    api = _api(root, db_url)
    with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
        return sorted(s.id for s in gb.students)


def write_feedback(day: str, root: Path, db_url: str | None = None,
                   students: list[str] | None = None) -> list[Path]:
    """feedback/<student>/<day>/<day>.html for every graded student of `day` (or of
    `students`); a student without a graded submission, or graded `missing` (nothing handed
    in), is skipped (graded_students lists who has one: the command line names those
    skipped)."""
    from nbgrader.api import Gradebook, MissingEntry

    api = _api(root, db_url)
    written = []
    with Gradebook(api.coursedir.db_url, api.coursedir.course_id) as gb:
        ids = students if students is not None else sorted(s.id for s in gb.students)
        for student in ids:
            graded = root / "autograded" / student / day / f"{day}.ipynb"
            try:
                submission = gb.find_submission_notebook(day, day, student)
            except MissingEntry:
                continue
            if not graded.exists() or not submitted_work(root, student, day):
                continue
            grades = {g.name: (float(g.score), float(g.max_score)) for g in submission.grades}
            target = root / "feedback" / student / day / f"{day}.html"
            target.parent.mkdir(parents=True, exist_ok=True)
            record = grading_record(root, student, day)
            limit_note = (f"{record['status']}: {record.get('reason', '')}"
                          if record.get("status") in GRADER_LIMITS else "")
            target.write_text(feedback_html(day, student, read(graded), grades,
                                            record.get("evidence", ""), limit_note))
            written.append(target)
    return written
