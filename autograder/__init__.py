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
