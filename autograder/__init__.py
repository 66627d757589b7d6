"""The course's grading machinery: nbgrader settings, notebook checks and the mistakes corpus.

    settings.py       the nbgrader configuration (solutions/ -> course/), used everywhere
    preprocessors.py  our one change to nbgrader's autograding (stderr costs no points)
    notebooks.py      finding days, exercises (answer cell + test cell), metadata lint
    grading.py        nbgrader's generate -> autograde flow in a scratch course folder
    kernel.py         running a notebook's cells in a Jupyter kernel, with an answer swapped out
    mistakes/         one module per day: plausible wrong answers that must lose their points
    authoring.py      building nbgrader notebooks from Python (for maintainers)
    __main__.py       the command line: python -m autograder ...
"""

import sys

# nbformat, which every command here imports, imports jsonschema, and jsonschema imports
# rfc3987_syntax when it is installed (jupyter-events asks for jsonschema[format-nongpl]). That
# module builds dozens of Earley parsers as it is imported: about 2 s of CPU in every process,
# and the grader starts many (a CLI call, a worker per slot, a preflight probe). The parsers only
# check the `iri` string formats, which no notebook schema uses, so our processes do without:
# a None in sys.modules makes `import rfc3987_syntax` fail, and jsonschema skips those two
# checks (upstream: python-jsonschema/jsonschema issue 1428).
sys.modules.setdefault("rfc3987_syntax", None)
