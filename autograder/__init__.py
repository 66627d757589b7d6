"""The course's grading machinery: nbgrader settings, notebook checks and the mistakes corpus.

    settings.py        the nbgrader configuration (solutions/ -> course/), used everywhere
    nbgrader_config.py the same settings for nbgrader's own commands run from this folder
    preprocessors.py   our changes to nbgrader's autograding (stderr and a test's value cost
                       and give no points)
    notebooks.py       finding days, exercises (answer cell + test cell), metadata lint
    grading.py         nbgrader's generate -> autograde flow; `release` (make release)
    kernel.py          running a notebook's cells in a Jupyter kernel, with an answer swapped out
    collect.py         importing submissions (a folder or an LMS zip) into submitted/
    grade.py           grading a day: stage, execute in parallel, record (`grade`)
    staging.py         repairing a submission against the released notebook
    preflight.py       before grading: can the grader's kernel import what the notebook does?
    worker.py          the execution step in a process of its own, one student or many
    warm.py            a fresh sandboxed kernel per student, started before their turn
    sandbox.py         the bubblewrap sandbox around a student's kernel
    execute.py         running a submission's cells under time and memory limits
    integrity.py       the static scan against submissions that fake their grade
    guard.py           the in-kernel guard: restores the checks and signs its reports
    reports.py         the grades CSV, per-student feedback and item analysis
    mistakes/          one module per day: plausible wrong answers that must lose their points
    mutants.py         mutation testing: single-point mutants of the answer cells
    cheats.py          the cheating corpus: submissions that fake their grade, and the verdict
    bad_submissions.py the bad-submission corpus: what must not break grading
    bench_grading.py   how fast the grader gets through a class (`make bench-grading`)
    authoring.py       building nbgrader notebooks from Python (for maintainers)
    __main__.py        the command line: python -m autograder ...
"""

import sys

# nbformat, which every command here imports, imports jsonschema, and jsonschema imports
# rfc3987_syntax when it is installed (jupyter-events asks for jsonschema[format-nongpl]). That
# module builds dozens of Earley parsers as it is imported: about 2 s of CPU in every process
# (AVX2 EPYC, 2026-11-28), and the grader starts many (a CLI call, a worker per slot, a
# preflight probe). The parsers only check the `iri` string formats, which no notebook schema
# uses, so our processes do without: a None in sys.modules makes `import rfc3987_syntax` fail,
# and jsonschema skips those two checks (upstream: python-jsonschema/jsonschema issue 1428).
sys.modules.setdefault("rfc3987_syntax", None)
