"""Chapters on disk: ``practice/chapters/chNN/chapter.json`` and the exercises it registers.

::

    practice/chapters/ch01/chapter.json          the registry (shipped)
    practice/chapters/ch01/test_public.py        public tests (shipped)
    practice/hidden/chapters/ch01/test_hidden.py hidden tests (instructor only)
    practice/hidden/chapters/ch01/wrong/<name>.<variant>.py
                                                 wrong bodies for region ch01.<name> (instructor only)

``chapter.json``::

    {"chapter": "ch01", "title": "The engine", "notebook": "notebooks/01_the_engine.ipynb",
     "exercises": [{"id": "ch01.block_hash", "title": "A chained block hash",
                    "section": "Exercise 1 · A chained block hash", "points": 2}]}

An exercise may say ``"scoring": "share"``: a part in which the learner writes tests (its
id ends in ``_tests``). Its cases named ``..._catches_...`` each give the learner's tests one
buggy variant of a component; the share of them that pass (the variants caught) is the share
of the points, provided every other case of the part passes (the tests pass on the
reference): see ``chapter_run.exercise_results``. Other parts are all or nothing.

Every exercise id is a region in ``course_lib`` and every region is an exercise of
exactly one chapter (``consistency`` says what is off). Hidden tests are looked up in
``$COURSE_HIDDEN_DIR/chapters/chNN/`` when that is set, else ``practice/hidden/chapters/chNN/``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from judging import regions
from judging.problems import PRACTICE

CHAPTERS = PRACTICE / "chapters"
CHAPTER_ID = re.compile(r"ch\d\d")


@dataclass(frozen=True)
class Exercise:
    id: str
    title: str
    section: str
    points: float
    scoring: str = "all"  # "all": all or nothing; "share": a test-writing part (module docstring)

    @property
    def name(self) -> str:
        return self.id.split(".", 1)[1]


@dataclass
class Chapter:
    id: str
    path: Path
    title: str
    notebook: str
    exercises: list[Exercise] = field(default_factory=list)
    # The notebook's warm-up cells (nbgrader solution cells outside course_lib): the learner
    # answers them in the notebook, whose own cell checks them; the judge does not grade them.
    warmups: tuple[str, ...] = ()
    speed: dict | None = None  # the "make it fast" part: {"exercise": id, "scenario": "module:function"}

    @property
    def number(self) -> str:
        return self.id.removeprefix("ch")

    def exercise(self, exercise_id: str) -> Exercise:
        for ex in self.exercises:
            if ex.id == exercise_id:
                return ex
        known = ", ".join(e.id for e in self.exercises)
        raise KeyError(f"{self.id} has no exercise {exercise_id!r} (its exercises: {known})")

    def public_files(self) -> list[Path]:
        """The public tests and any support modules beside them: what a graded run copies."""
        return sorted(p for p in self.path.glob("*.py") if p.name != "conftest.py"
                      and (not p.name.startswith("test_") or p.name == "test_public.py"))

    def hidden_dir(self) -> Path:
        root = os.environ.get("COURSE_HIDDEN_DIR")
        return (Path(root) if root else PRACTICE / "hidden") / "chapters" / self.id

    def hidden_files(self) -> list[Path]:
        """Hidden test files and their helpers; empty when this edition has none."""
        d = self.hidden_dir()
        if not d.is_dir() or not list(d.glob("test_*.py")):
            return []
        shared = sorted((d.parent / "shared").glob("*.py"))  # scenarios every chapter may use (twin.py)
        return sorted(p for p in d.glob("*.py") if p.name != "conftest.py") + shared

    def wrong_variants(self, exercise: Exercise | None = None) -> list[tuple[Exercise, str, Path]]:
        """(exercise, variant name, file) for each wrong body in ``hidden/chapters/chNN/wrong/``."""
        out = []
        for ex in ([exercise] if exercise else self.exercises):
            for f in sorted((self.hidden_dir() / "wrong").glob(f"{ex.name}.*.py")):
                out.append((ex, f.name[len(ex.name) + 1:-3], f))
        return out

    def stub(self, exercise: Exercise) -> str:
        return regions.stub_line(exercise.id, self.id, self.notebook, exercise.section)


def load(chapter_id: str, chapters_dir: Path = CHAPTERS) -> Chapter:
    path = Path(chapters_dir) / chapter_id
    where = f"{chapter_id}/chapter.json"
    if not CHAPTER_ID.fullmatch(chapter_id) or not (path / "chapter.json").is_file():
        d = Path(chapters_dir)
        known = ", ".join(sorted(p.name for p in d.iterdir() if (p / "chapter.json").is_file())) if d.is_dir() else ""
        known = known or "none"
        raise KeyError(f"no chapter {chapter_id!r} (known: {known})")
    try:
        meta = json.loads((path / "chapter.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    missing = [k for k in ("chapter", "title", "notebook", "exercises") if k not in meta]
    if missing:
        raise ValueError(f"{where}: lacks {', '.join(missing)}")
    if meta["chapter"] != chapter_id:
        raise ValueError(f"{where}: says chapter {meta['chapter']!r}, but sits in {chapter_id}/")
    exercises = []
    for i, ex in enumerate(meta["exercises"]):
        lacks = [k for k in ("id", "title", "section", "points") if k not in ex]
        if lacks:
            raise ValueError(f"{where}: exercise {i + 1} lacks {', '.join(lacks)}")
        if not regions.ID.fullmatch(ex["id"]) or not ex["id"].startswith(chapter_id + "."):
            raise ValueError(f"{where}: exercise id {ex['id']!r} must read '{chapter_id}.name' (lower-case name)")
        if not isinstance(ex["points"], (int, float)) or ex["points"] <= 0:
            raise ValueError(f"{where}: {ex['id']} has points {ex['points']!r}; give a positive number")
        scoring = ex.get("scoring", "all")
        if scoring not in ("all", "share") or (scoring == "share") != ex["id"].endswith("_tests"):
            raise ValueError(f"{where}: {ex['id']} has scoring {scoring!r}: a test-writing part (an id ending in "
                             "'_tests') is scored by share (\"scoring\": \"share\"), every other part all or nothing")
        exercises.append(Exercise(ex["id"], ex["title"], ex["section"], ex["points"], scoring))
    ids = [e.id for e in exercises]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: an exercise id is listed twice: {ids}")
    warmups = meta.get("warmups", [])
    if not (isinstance(warmups, list) and all(isinstance(w, str) and w.isidentifier() for w in warmups)):
        raise ValueError(f"{where}: warmups must be a list of the notebook's warm-up function names, got {warmups!r}")
    speed = meta.get("speed")
    if speed is not None and not (isinstance(speed, dict) and speed.get("exercise") in ids
                                  and re.fullmatch(r"speed_scenarios:[a-z_]+", str(speed.get("scenario")))):
        raise ValueError(f"{where}: speed must be {{\"exercise\": one of {ids}, \"scenario\": "
                         f"\"speed_scenarios:<name>\"}}, got {speed!r}")
    return Chapter(chapter_id, path, meta["title"], meta["notebook"], exercises, tuple(warmups), speed)


def all_chapters(chapters_dir: Path = CHAPTERS) -> list[Chapter]:
    d = Path(chapters_dir)
    if not d.is_dir():
        return []
    return [load(p.name, d) for p in sorted(d.iterdir()) if CHAPTER_ID.fullmatch(p.name) and (p / "chapter.json").is_file()]


def consistency(root: Path, chapters: list[Chapter]) -> list[str]:
    """What is off between the regions under ``root/course_lib`` and the registries (empty: all agree)."""
    found = {r.id: r for r in regions.find(root)}
    registered: dict[str, str] = {}
    problems = []
    for ch in chapters:
        for ex in ch.exercises:
            if ex.id in registered:
                problems.append(f"{ex.id} is registered by both {registered[ex.id]} and {ch.id}")
            registered[ex.id] = ch.id
            if ex.id not in found:
                problems.append(f"{ch.id}/chapter.json lists {ex.id}, but no region in course_lib has that id")
    for rid, region in found.items():
        if rid not in registered:
            problems.append(f"region {rid} ({region.path}:{region.begin + 1}) is in no chapter.json")
    return problems


def stub_bodies(chapters: list[Chapter], only: set[str] | None = None) -> dict[str, str]:
    """{exercise id: stub body} for every registered exercise (or those in ``only``)."""
    return {ex.id: ch.stub(ex) + "\n" for ch in chapters for ex in ch.exercises if only is None or ex.id in only}
