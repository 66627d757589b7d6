"""Before grading anyone: can the grader's kernel import what the day's notebook imports?

A broken grading environment (a package missing from the sandbox, an editable install of
tinygpt that points outside the folders the sandbox binds) would otherwise look like a class
of zeros: every submission fails the same import and scores 0 with status `graded`.
`check_imports` runs every top-level import statement of the released notebook in a kernel
started exactly as the students' kernels are (the same sandbox, environment and working
folder) and raises PreflightError naming each import that fails, before any grade is written.
"""

from __future__ import annotations

import ast
import json
import shutil
import tempfile
from pathlib import Path

from autograder.kernel import Kernel, error_text, grading_env
from autograder.sandbox import DEFAULT_MEMORY_BYTES, SandboxKernelManager, SandboxPolicy

IMPORT_TIMEOUT_S = 120.0  # importing torch on a busy machine takes seconds, not minutes


class PreflightError(RuntimeError):
    """The grading environment cannot run the day's notebook; nothing was graded."""


def import_statements(nb) -> list[str]:
    """The distinct top-level `import` / `from ... import` statements of `nb`'s code cells, in
    order (imports inside functions, `if` or `try` blocks are left out: they may be optional)."""
    found: list[str] = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:  # IPython magics, or a student's broken cell: nothing to check
            continue
        for node in tree.body:
            if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
                found.append(ast.unparse(node))
    return list(dict.fromkeys(found))


def _probe(statements: list[str]) -> str:
    """Kernel code that runs each statement on its own and prints the failures as JSON."""
    return (
        "import json as _json\n"
        "_failed = []\n"
        f"for _statement in {statements!r}:\n"
        "    try:\n"
        "        exec(_statement, {})\n"
        "    except BaseException as _err:  # noqa\n"
        "        _failed.append([_statement, f'{type(_err).__name__}: {_err}'])\n"
        "print('PREFLIGHT' + _json.dumps(_failed))\n")


def host_tinygpt() -> str:
    """Where this process imports tinygpt from (for the error message)."""
    import tinygpt

    return str(Path(tinygpt.__file__).resolve().parent)


def check_imports(nb, *, files: Path | None = None, sandbox: bool = True,
                  memory_bytes: int = DEFAULT_MEMORY_BYTES,
                  timeout: float = IMPORT_TIMEOUT_S) -> list[str]:
    """Run `nb`'s import statements in a grading kernel (sandboxed unless `sandbox` is False);
    return them when all succeed, else raise PreflightError naming what is missing.
    `files`: the folder whose non-notebook files a student's kernel gets (course/<day>)."""
    statements = import_statements(nb)
    if not statements:
        return statements
    with tempfile.TemporaryDirectory(prefix="tinygpt-preflight-") as tmp:
        scratch = Path(tmp) / "work"
        scratch.mkdir()
        if files is not None and files.is_dir():
            for item in files.iterdir():
                if item.suffix != ".ipynb" and item.name != ".ipynb_checkpoints":
                    copy = shutil.copytree if item.is_dir() else shutil.copy
                    copy(item, scratch / item.name)
        manager = SandboxKernelManager(SandboxPolicy(scratch, memory_bytes)) if sandbox else None
        try:
            with Kernel(scratch, timeout=timeout, manager=manager,
                        env=None if sandbox else grading_env()) as kernel:
                outputs = kernel.run(_probe(statements), timeout=timeout)
        except Exception as err:  # noqa: BLE001 (the kernel itself did not start)
            raise PreflightError(
                f"the grading kernel did not start ({type(err).__name__}: {err}); nothing was "
                "graded") from err
    text = "".join(str(o.get("text", "")) for o in outputs if o.get("output_type") == "stream")
    if "PREFLIGHT" not in text:
        raise PreflightError("the import check did not finish in the grading kernel ("
                             f"{error_text(outputs) or 'no output'}); nothing was graded")
    failed = json.loads(text.split("PREFLIGHT", 1)[1].strip().splitlines()[0])
    if failed:
        lines = "\n".join(f"  {statement}  ->  {error}" for statement, error in failed)
        where = "the sandbox" if sandbox else "the grading kernel"
        raise PreflightError(
            f"{where} cannot import what the notebook imports, so every submission would "
            f"fail alike; nothing was graded:\n{lines}\n"
            f"This process imports tinygpt from {host_tinygpt()}; the sandbox binds the "
            "folders the grader imports its packages from (autograder/sandbox.py). Install "
            "what is missing into the grader's Python environment and grade again.")
    return statements
