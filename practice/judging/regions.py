"""Exercise regions in ``course_lib``: find them, stub them, put a body back.

A region is the learner's part of a function, between two comment lines::

        # BEGIN EXERCISE ch01.block_hash
        ...  # the reference code: the part the learner writes
        # END EXERCISE

The markers are plain comments, so the instructor edition runs as if they were absent.
The region sits inside a function body, after the signature and docstring; its
indentation is the BEGIN line's. In the student edition the body becomes one
``raise NotImplementedError(...)`` line and the markers stay, so the learner sees where
to write and the judge can find the region again (to check it, or to put a body in).

The rules are strict on purpose: a marker line that is almost right (a typo, a missing
id, a nested region, an END without a BEGIN) is an error that names the file and line,
never a region silently left out of the student edition.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

BEGIN = "# BEGIN EXERCISE"
END = "# END EXERCISE"
ID = re.compile(r"ch\d\d\.[a-z][a-z0-9_]*")
_BEGIN_LINE = re.compile(r"^(?P<indent>[ \t]*)# BEGIN EXERCISE (?P<id>\S+)[ \t]*$")
_END_LINE = re.compile(r"^[ \t]*# END EXERCISE[ \t]*$")
_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints"}


class RegionError(ValueError):
    """A marker that breaks the rules; the message names the file and line."""


@dataclass(frozen=True)
class Region:
    id: str
    path: Path      # the source file
    begin: int      # 0-based index of the BEGIN line
    end: int        # 0-based index of the END line
    indent: str     # the BEGIN line's indentation, which the body shares
    body: str       # the lines between the markers, as written (ends with a newline unless empty)

    @property
    def chapter(self) -> str:
        return self.id.split(".", 1)[0]

    @property
    def name(self) -> str:
        """The id without its chapter: ``block_hash`` for ``ch01.block_hash``."""
        return self.id.split(".", 1)[1]

    def code_lines(self) -> list[str]:
        """The body's lines that are code: stripped, without blank and comment-only lines."""
        return [s for s in (line.strip() for line in self.body.splitlines()) if s and not s.startswith("#")]


def parse(text: str, path: Path | str = "<text>") -> list[Region]:
    """The regions of one file's text, in order; a broken marker raises ``RegionError``."""
    lines = text.splitlines(keepends=True)
    regions, open_at, open_id, indent = [], None, None, ""
    for i, line in enumerate(lines):
        where = f"{path}:{i + 1}"
        stripped = line.strip()
        if "BEGIN EXERCISE" in line:
            m = _BEGIN_LINE.match(line.rstrip("\r\n"))
            if not m or not ID.fullmatch(m["id"]):
                raise RegionError(f"{where}: a BEGIN marker must read '{BEGIN} chNN.name' "
                                  f"(lower-case name), got {stripped!r}")
            if open_at is not None:
                raise RegionError(f"{where}: {m['id']} begins inside {open_id} (line {open_at + 1}); "
                                  "regions do not nest")
            open_at, open_id, indent = i, m["id"], m["indent"]
        elif "END EXERCISE" in line:
            if not _END_LINE.match(line.rstrip("\r\n")):
                raise RegionError(f"{where}: an END marker must read exactly '{END}', got {stripped!r}")
            if open_at is None:
                raise RegionError(f"{where}: '{END}' without a BEGIN marker before it")
            body = "".join(lines[open_at + 1:i])
            region = Region(open_id, Path(path), open_at, i, indent, body)
            if not region.code_lines():
                raise RegionError(f"{path}:{open_at + 1}: region {open_id} has no code between its markers")
            regions.append(region)
            open_at = None
    if open_at is not None:
        raise RegionError(f"{path}:{open_at + 1}: region {open_id} has no '{END}' line")
    return regions


def source_files(root: Path) -> list[Path]:
    """Every ``.py`` file of ``root/course_lib`` (``root`` is an edition's top folder)."""
    package = Path(root) / "course_lib"
    if not package.is_dir():
        raise RegionError(f"no course_lib/ in {root}")
    return sorted(p for p in package.rglob("*.py") if not _SKIP_DIRS & set(p.parts))


def find(root: Path) -> list[Region]:
    """All regions under ``root/course_lib``; ids must be unique across the tree."""
    found: dict[str, Region] = {}
    for path in source_files(root):
        for region in parse(path.read_text(encoding="utf-8"), path):
            if region.id in found:
                first = found[region.id]
                raise RegionError(f"{path}:{region.begin + 1}: region id {region.id} is used twice "
                                  f"(first at {first.path}:{first.begin + 1})")
            found[region.id] = region
    return list(found.values())


def stub_line(exercise_id: str, chapter: str, notebook: str, section: str) -> str:
    """The one statement a stubbed region holds (without indentation or newline).

    The section is quoted with “ ” so that an apostrophe in its title is never escaped:
    the learner reads the message in the source exactly as it is printed."""
    number = chapter.removeprefix("ch")
    message = (f"{exercise_id}: write this part (chapter {number}, {notebook}, section “{section}”); "
               f"then run: python practice/judge.py test {chapter}")
    return f"raise NotImplementedError({message!r})"


def indent_body(body: str, indent: str) -> str:
    """``body`` (written at column 0) re-indented to ``indent``; blank lines stay blank."""
    lines = body.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    return "".join((indent + line if line.strip() else "") + "\n" for line in lines)


def replace_bodies(text: str, bodies: dict[str, str], path: Path | str = "<text>") -> str:
    """``text`` with the body of each region named in ``bodies`` replaced.

    A new body is written at column 0 and re-indented to its region's indentation; the
    markers stay. Regions not named keep their body."""
    lines = text.splitlines(keepends=True)
    for region in reversed(parse(text, path)):  # from the end, so earlier line numbers hold
        if region.id in bodies:
            lines[region.begin + 1:region.end] = [indent_body(bodies[region.id], region.indent)]
    return "".join(lines)


def dedent_body(region: Region) -> str:
    """A region's body moved to column 0 (the form a replacement body is written in)."""
    out = []
    for line in region.body.splitlines():
        if line.strip() and not line.startswith(region.indent):
            raise RegionError(f"{region.path}: a line of region {region.id} is indented less than "
                              f"its BEGIN marker: {line.strip()!r}")
        out.append(line[len(region.indent):] if line.strip() else "")
    return "\n".join(out) + "\n"


EDITION_FILE = Path("course_lib") / "edition.py"  # the marker the engine's fast paths read


def mark_edition(root: Path, *, student: bool = False, replaced=()) -> None:
    """Say in ``root``'s ``course_lib/edition.py`` what its regions hold: the student
    edition's (``student``: learners' code or stubs), or the instructor edition's except
    the regions in ``replaced`` (a maintainer's copy with those bodies swapped). The
    engine's fast paths stand in for a part only where it is the reference, so a tree
    whose regions were changed must say so here."""
    path = Path(root) / EDITION_FILE
    text = path.read_text(encoding="utf-8")
    edition = f'EDITION = "{"student" if student else "instructor"}"'
    line = next((ln for ln in text.splitlines() if ln.startswith("REPLACED")), "")
    before = set(re.findall(r"\"(ch\d\d\.[a-z0-9_]+)\"", line))
    ids = ", ".join(f'"{i}"' for i in sorted(before | set(replaced)))
    lines = []
    for line in text.splitlines():
        if line.startswith("EDITION ="):
            line = edition
        elif line.startswith("REPLACED"):
            line = f"REPLACED: frozenset[str] = frozenset({{{ids}}})" if ids else "REPLACED: frozenset[str] = frozenset()"
        lines.append(line)
    if edition not in lines or not any(line.startswith("REPLACED") for line in lines):
        raise RegionError(f"{path}: expected the lines 'EDITION = ...' and 'REPLACED: ...'")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
