"""Import submissions into submitted/<student>/<day>/, as nbgrader expects them.

Two layouts are accepted:
- a folder of `<student>/<dayNN...>/*.ipynb` (what nbgrader's exchange or a shared drive gives);
- a zip as learning-management systems export it: one notebook per student, the student id in
  the file name. The default pattern reads `<student>_<dayNN>[_anything].ipynb`; pass another
  regular expression with the named groups `student` and `day` for other exports
  (`compile_pattern` checks it; a pattern with a folder source is refused, it would be unused).

The day may be written `day07` or in full (`day07_sampling`); it is matched to the course's
day ids. Every file that cannot be placed is reported with the reason, nothing is dropped
silently. A submission older than the one already collected for the same student and day
is not imported (reported with both dates); timestamp.txt holds when it was handed in (the
newest file's time, the zip entry's date; for an empty folder the time of collection). Files
are written to paths we build (never to paths taken from the archive), and
oversized entries are refused; an entry that cannot be read (damaged, encrypted) is reported
and the others are imported. A source that does not exist, is empty or is neither a folder
nor a zip file, and a pattern that does not compile or lacks a group, raise CollectError
before anything is imported.
"""

from __future__ import annotations

import datetime as dt
import re
import shutil
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from autograder.notebooks import days as course_days

# The student group takes any letter (not only ASCII), so that a name such as "José" is
# refused by STUDENT_ID with its rule, as it is from a folder, not as an unmatched file name.
DEFAULT_PATTERN = (r"^(?P<student>[^\W_](?:[^\W_]|[.@-])*?)[_ -]+(?P<day>day\d\d)"
                   r"(?:[_-][^/]*)?\.ipynb$")
MAX_NOTEBOOK_BYTES = 50 * 1024 * 1024
STUDENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.@_-]{0,63}$")
STUDENT_ID_RULE = ("1 to 64 letters, digits, '.', '@', '_' or '-', starting with a letter or "
                   "digit")
PATTERN_GROUPS = ("student", "day")


class CollectError(ValueError):
    """A source or pattern `collect` cannot use; nothing was imported."""


def check_source(source: Path | str) -> Path:
    """`source` as a Path when it is a folder or a zip file; else CollectError saying why."""
    if str(source) == "":
        raise CollectError("the source is empty: give a folder or a .zip file")
    source = Path(source)
    if not source.exists():
        raise CollectError(f"{source} does not exist")
    if source.is_dir() or zipfile.is_zipfile(source):
        return source
    if source.suffix.lower() == ".zip":
        raise CollectError(f"{source} is not a zip file (it ends in .zip, but its contents are "
                           "not a zip archive)")
    raise CollectError(f"{source} is neither a folder nor a .zip file")


def compile_pattern(pattern: str) -> re.Pattern:
    """`pattern` compiled, with the named groups `student` and `day`; else CollectError."""
    if not pattern:
        raise CollectError("--pattern is empty: give a regular expression with the named groups "
                           "'student' and 'day' (or leave --pattern out for the default)")
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise CollectError(f"--pattern {pattern!r} is not a regular expression: {err}") from None
    missing = [g for g in PATTERN_GROUPS if g not in compiled.groupindex]
    if missing:
        raise CollectError(f"--pattern {pattern!r} lacks the named group(s) "
                           f"{', '.join(missing)}: it needs (?P<student>...) and (?P<day>...)")
    return compiled


@dataclass
class CollectReport:
    imported: list[tuple[str, str, str]] = field(default_factory=list)  # student, day, source
    unmatched: list[tuple[str, str]] = field(default_factory=list)  # source, why

    def text(self) -> str:
        lines = [f"imported {len(self.imported)} submission(s)"]
        lines += [f"  {student:<20} {day:<20} <- {source}"
                  for student, day, source in self.imported]
        if self.unmatched:
            lines.append(f"could not place {len(self.unmatched)} file(s):")
            lines += [f"  {source}: {why}" for source, why in self.unmatched]
        return "\n".join(lines)


def resolve_day(name: str, known: list[str]) -> str | None:
    """'day07', 'Day07' or 'day07_sampling' -> the course's day id, or None."""
    match = re.match(r"(?i)day(\d\d)", name)
    if not match:
        return None
    prefix = f"day{match.group(1)}"
    return next((d for d in known if d.split("_")[0] == prefix and
                 (name.lower() == prefix or name.lower() == d)), None)


def _unusable_id(student: str) -> str:
    """Why `student` cannot be a student id: the same words for a folder and a zip entry."""
    return f"{student!r} is not a usable student id ({STUDENT_ID_RULE})"


def _timestamp(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f UTC")


def _collected_at(target: Path) -> dt.datetime | None:
    """When the submission already in `target` was handed in (its timestamp.txt), or None."""
    try:
        text = (target / "timestamp.txt").read_text().strip()
        return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f UTC").replace(tzinfo=dt.UTC)
    except (OSError, ValueError):
        return None


def _store(root: Path, student: str, day: str, files: dict[str, bytes],
           when: dt.datetime) -> str:
    """Write one submission to submitted/<student>/<day>/, replacing the one there unless that
    one is newer; returns "" when stored, else why not."""
    target = root / "submitted" / student / day
    previous = _collected_at(target)
    if previous is not None and previous > when:
        return (f"older ({_timestamp(when)}) than the submission of {student} {day} already "
                f"collected ({_timestamp(previous)}): kept that one")
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for name, data in files.items():
        (target / name).write_bytes(data)
    (target / "timestamp.txt").write_text(_timestamp(when))
    return ""


def collect(source: Path, root: Path, pattern: str | None = None) -> CollectReport:
    """Import `source` (a folder or a .zip) into `root`/submitted; returns what happened.
    `pattern`: for a zip only (default DEFAULT_PATTERN). Raises CollectError before importing
    anything when the source or the pattern cannot be used."""
    source = check_source(source)
    if source.is_dir() and pattern is not None:
        raise CollectError(f"--pattern applies to a .zip source only; {source} is a folder "
                           "(<student>/<dayNN>/*.ipynb)")
    compiled = compile_pattern(DEFAULT_PATTERN if pattern is None else pattern)
    known, report = course_days(root), CollectReport()
    if source.is_dir():
        _collect_folder(source, root, known, report)
    else:
        _collect_zip(source, root, compiled, known, report)
    return report


def _collect_folder(source: Path, root: Path, known: list[str], report: CollectReport) -> None:
    for path in sorted(source.rglob("*")):
        if not path.is_file() or ".ipynb_checkpoints" in path.parts:
            continue
        rel = path.relative_to(source)
        if len(rel.parts) != 3:
            report.unmatched.append((str(rel), "expected <student>/<day>/<file>"))
    for student_dir in sorted(p for p in source.iterdir() if p.is_dir()):
        student = student_dir.name
        for day_dir in sorted(p for p in student_dir.iterdir() if p.is_dir()):
            rel = f"{student}/{day_dir.name}"
            day = resolve_day(day_dir.name, known)
            if not STUDENT_ID.match(student):
                report.unmatched.append((rel, _unusable_id(student)))
                continue
            if day is None:
                report.unmatched.append((rel, f"{day_dir.name!r} is not a day of this course "
                                              f"({', '.join(known)})"))
                continue
            files = {}
            for path in sorted(p for p in day_dir.iterdir() if p.is_file()):
                if path.stat().st_size > MAX_NOTEBOOK_BYTES:
                    report.unmatched.append((f"{rel}/{path.name}", f"larger than "
                                             f"{MAX_NOTEBOOK_BYTES // 2**20} MiB"))
                else:
                    files[path.name] = path.read_bytes()
            times = [p.stat().st_mtime for p in day_dir.iterdir() if p.is_file()]
            when = dt.datetime.fromtimestamp(max(times), dt.UTC) if times else \
                dt.datetime.now(dt.UTC)   # an empty folder: handed in when collected
            _place(root, student, day, files, when, rel, report)


def _collect_zip(source: Path, root: Path, pattern: re.Pattern, known: list[str],
                 report: CollectReport) -> None:
    chosen: dict[tuple[str, str], zipfile.ZipInfo] = {}
    expected = ("<student>_<dayNN>...ipynb" if pattern.pattern == DEFAULT_PATTERN
                else repr(pattern.pattern))
    with zipfile.ZipFile(source) as archive:
        for info in archive.infolist():
            if info.is_dir() or "__MACOSX" in info.filename:
                continue
            name = Path(info.filename).name
            match = pattern.match(name)
            if not name.endswith(".ipynb"):
                report.unmatched.append((info.filename, "not a notebook"))
            elif match is None:
                report.unmatched.append((info.filename, "file name does not match the pattern "
                                                        f"{expected}"))
            elif (day := resolve_day(match.group("day"), known)) is None:
                report.unmatched.append((info.filename, f"{match.group('day')!r} is not a day "
                                                        "of this course"))
            elif not STUDENT_ID.match(match.group("student")):
                report.unmatched.append((info.filename, _unusable_id(match.group("student"))))
            elif info.file_size > MAX_NOTEBOOK_BYTES:
                report.unmatched.append((info.filename, f"larger than "
                                                        f"{MAX_NOTEBOOK_BYTES // 2**20} MiB"))
            else:
                key = (match.group("student"), day)
                if key in chosen:
                    older, newer = sorted([chosen[key], info], key=lambda i: i.date_time)
                    report.unmatched.append((older.filename, f"a later file for {key[0]} "
                                                             f"{key[1]} was taken instead"))
                    chosen[key] = newer
                else:
                    chosen[key] = info
        for (student, day), info in sorted(chosen.items()):
            when = dt.datetime(*info.date_time, tzinfo=dt.UTC)
            try:
                data = archive.read(info)
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError,
                    RuntimeError) as err:   # a damaged, encrypted or unsupported entry
                report.unmatched.append((info.filename, f"cannot be read from the zip "
                                                        f"({type(err).__name__}: {err})"))
                continue
            _place(root, student, day, {f"{day}.ipynb": data}, when, info.filename, report)


def _place(root: Path, student: str, day: str, files: dict[str, bytes], when: dt.datetime,
           source: str, report: CollectReport) -> None:
    """_store one submission and report it as imported, or as not placed with the reason."""
    refused = _store(root, student, day, files, when)
    if refused:
        report.unmatched.append((source, refused))
    else:
        report.imported.append((student, day, source))
