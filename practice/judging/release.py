"""The judge's step of building the student edition: practice/ without answers or hidden tests.

What is copied is an allow-list (the judge; the learner's part of README.md, up to the
line ``LEARNERS_END`` marks; per problem its problem.md, starter.py, test_public.py and
support modules; per chapter its chapter.json, test_public.py and support modules, plus
chapters/conftest.py), and the result is then checked: a released file whose text equals
a solution, a wrong answer or a hidden test stops the release.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from judging.chapters import CHAPTERS, all_chapters
from judging.problems import PRACTICE, all_problems

TOP_FILES = ["judge.py", ".gitignore"]
# The line of practice/README.md after which it speaks to instructors and maintainers only.
LEARNERS_END = "<!-- The student edition's copy of this file ends here"


def release(dest: Path, force: bool = False) -> list[Path]:
    """Copy the student edition of practice/ into ``dest``; return the files written."""
    dest = Path(dest)
    if dest.resolve() == PRACTICE.resolve() or PRACTICE.resolve() in dest.resolve().parents:
        raise ValueError(f"{dest} is inside the instructor edition's practice/ directory")
    if dest.exists() and any(dest.iterdir()):
        if not force:
            raise FileExistsError(f"{dest} exists and is not empty; use --force to replace it")
        shutil.rmtree(dest)
    written = [_copy(PRACTICE / name, dest / name) for name in TOP_FILES if (PRACTICE / name).is_file()]
    written.append(_learners_readme(PRACTICE / "README.md", dest / "README.md"))
    written += [_copy(p, dest / "judging" / p.name) for p in sorted((PRACTICE / "judging").glob("*.py"))]
    secrets = []
    for problem in all_problems():
        for src in [problem.path / "problem.md", problem.starter] + problem.public_files():
            written.append(_copy(src, dest / "problems" / problem.slug / src.name))
        secrets += [problem.solution, *problem.wrong_answers(), *sorted(problem.hidden_dir().glob("*.py"))]
    if (CHAPTERS / "conftest.py").is_file():
        written.append(_copy(CHAPTERS / "conftest.py", dest / "chapters" / "conftest.py"))
    for chapter in all_chapters():
        for src in [chapter.path / "chapter.json"] + chapter.public_files():
            written.append(_copy(src, dest / "chapters" / chapter.id / src.name))
        if chapter.hidden_dir().is_dir():
            secrets += sorted(chapter.hidden_dir().rglob("*.py"))
    try:
        _check_no_secrets(written, [s for s in secrets if s.is_file()])
    except RuntimeError:
        shutil.rmtree(dest)  # never leave a leaking edition behind
        raise
    return written


def _learners_readme(src: Path, dst: Path) -> Path:
    """``src`` up to its ``LEARNERS_END`` line (which must be there: without it the whole
    file, instructors' part included, would ship)."""
    text = src.read_text(encoding="utf-8")
    if LEARNERS_END not in text:
        raise RuntimeError(f"release stopped: {src} has no line starting {LEARNERS_END!r}, so its instructors' "
                           "part cannot be left out")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(text[:text.index(LEARNERS_END)].rstrip() + "\n", encoding="utf-8")
    return dst


def _copy(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return dst


def _check_no_secrets(written: list[Path], secrets: list[Path]) -> None:
    secret_text = {s.read_bytes().strip(): s for s in secrets}
    for path in written:
        leaked = secret_text.get(path.read_bytes().strip())
        if leaked is not None:
            raise RuntimeError(f"release stopped: {path} has the same text as {leaked}")
