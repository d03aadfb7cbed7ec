"""Problems on disk: ``practice/problems/<slug>/`` with a front-matter ``problem.md``.

A problem directory holds ``problem.md``, ``starter.py``, ``test_public.py``, support
modules the tests import (e.g. ``layer.py``), and in the instructor edition also
``solution.py`` and ``wrong/*.py``. Hidden tests live apart, in ``$COURSE_HIDDEN_DIR/<slug>/``
or ``practice/hidden/<slug>/``, so the student edition can simply leave them out.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PRACTICE = Path(__file__).resolve().parent.parent
PROBLEMS = PRACTICE / "problems"
# What the judge says when this edition has no hidden tests for a problem.
HIDDEN_ABSENT = "hidden tests: not present in this edition (public tests only)"
# Files of a problem directory that are never tests or test support.
NOT_SUPPORT = {"problem.md", "starter.py", "solution.py"}


@dataclass
class Problem:
    slug: str
    path: Path
    title: str
    chapter: str
    difficulty: str
    tags: list[str] = field(default_factory=list)
    requires: list[str] = field(default_factory=list)
    points: float = 1.0  # what the gradebook gives a complete pass (front matter ``points:``)

    @property
    def needs_cuda(self) -> bool:
        return "cuda" in self.requires

    @property
    def starter(self) -> Path:
        return self.path / "starter.py"

    @property
    def solution(self) -> Path:
        return self.path / "solution.py"

    def wrong_answers(self) -> list[Path]:
        return sorted((self.path / "wrong").glob("*.py"))

    def public_files(self) -> list[Path]:
        """The public tests and the modules they import: what a graded run copies."""
        return sorted(p for p in self.path.glob("*.py")
                      if p.name not in NOT_SUPPORT and (not p.name.startswith("test_") or p.name == "test_public.py"))

    def hidden_dir(self) -> Path:
        """Where this problem's hidden tests would be; $COURSE_HIDDEN_DIR wins when set."""
        root = os.environ.get("COURSE_HIDDEN_DIR")
        return Path(root) / self.slug if root else PRACTICE / "hidden" / self.slug

    def hidden_files(self) -> list[Path]:
        """Hidden test files and their helpers; empty when this edition has none."""
        d = self.hidden_dir()
        if not d.is_dir() or not list(d.glob("test_*.py")):
            return []
        # Helpers every problem may use (solution_twin.py) and the chapters' twin.py, on which it builds.
        shared = sorted((d.parent / "shared").glob("*.py")) + [d.parent / "chapters" / "shared" / "twin.py"]
        return sorted(d.glob("*.py")) + [p for p in shared if p.is_file()]


def parse_front_matter(text: str, where: str = "problem.md") -> dict:
    """Parse the ``---``-fenced ``key: value`` block at the top of a problem.md.

    Values are strings, or lists written ``[a, b]`` or as ``- item`` lines. Written by
    hand because the grading machine may not have PyYAML; anything fancier is an error.
    """
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        raise ValueError(f"{where}: must start with a '---' front-matter line")
    try:
        end = next(i for i, line in enumerate(lines[1:], 1) if line.strip() == "---")
    except StopIteration:
        raise ValueError(f"{where}: front matter has no closing '---' line") from None
    meta: dict = {}
    key = None
    for n, raw in enumerate(lines[1:end], 2):
        line = raw.split(" #")[0].rstrip()
        if not line.strip():
            continue
        if line.lstrip().startswith("- ") and key is not None and isinstance(meta[key], list):
            meta[key].append(_scalar(line.lstrip()[2:]))
            continue
        if ":" not in line:
            raise ValueError(f"{where}, line {n}: expected 'key: value', got {raw!r}")
        key, value = (s.strip() for s in line.split(":", 1))
        if value.startswith("[") and value.endswith("]"):
            meta[key] = [_scalar(v) for v in value[1:-1].split(",") if v.strip()]
        elif value == "":
            meta[key] = []  # a block list follows (or the list is empty)
        else:
            meta[key] = _scalar(value)
    return meta


def _scalar(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def load(slug: str) -> Problem:
    path = PROBLEMS / slug
    if not (path / "problem.md").is_file():
        known = ", ".join(p.slug for p in all_problems()) or "none"
        raise KeyError(f"no problem {slug!r} (known: {known})")
    meta = parse_front_matter((path / "problem.md").read_text(encoding="utf-8"), f"{slug}/problem.md")
    missing = [k for k in ("title", "chapter", "difficulty") if k not in meta]
    if missing:
        raise ValueError(f"{slug}/problem.md: front matter lacks {', '.join(missing)}")
    as_list = lambda v: v if isinstance(v, list) else [v]  # noqa: E731 - "tags: int8" means [int8]
    try:
        points = float(meta.get("points", 1))
    except ValueError:
        raise ValueError(f"{slug}/problem.md: points must be a number, got {meta['points']!r}") from None
    return Problem(slug, path, meta["title"], str(meta["chapter"]), str(meta["difficulty"]),
                   as_list(meta.get("tags", [])), as_list(meta.get("requires", [])), points)


def all_problems() -> list[Problem]:
    if not PROBLEMS.is_dir():
        return []
    return [load(p.name) for p in sorted(PROBLEMS.iterdir()) if (p / "problem.md").is_file()]
