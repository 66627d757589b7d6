# nbgrader reads this file when run from this folder (`cd autograder && nbgrader ...`).
# The settings themselves live in autograder/settings.py, shared with `python -m autograder`.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autograder.settings import ensure_venv_on_path, nbgrader_config  # noqa: E402

ensure_venv_on_path()
c = get_config()  # noqa: F821 (provided by traitlets when it loads this file)
c.merge(nbgrader_config())
