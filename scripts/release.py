"""Build the student edition: the course with every exercise region stubbed, without solutions or hidden tests.

    python scripts/release.py                  # into student/ (git-ignored)
    python scripts/release.py --out DIR        # elsewhere; DIR is replaced (--dest is the same)

What it writes:
- course_lib/: the library with the body of every exercise region (``# BEGIN EXERCISE
  chNN.name`` ... ``# END EXERCISE``) replaced by one ``raise NotImplementedError(...)``
  naming the chapter, the exercise and the notebook section; the markers, signatures and
  docstrings stay. Every region must be registered in a practice/chapters/chNN/chapter.json.
- notebooks/: nbgrader ``generate_assignment`` of the chapter notebooks (solutions become
  ``raise NotImplementedError()``, hidden tests are removed). nbgrader records the
  assignment in a gradebook, which ``nbgrader autograde`` needs later: with
  ``--course-root DIR`` in DIR/gradebook.db (``--course-root grading`` is the folder
  nbgrader_config.py names); without it in a temporary folder, deleted afterwards.
- practice/: ``python practice/judge.py release`` (the judge's own step: problems without
  solutions or wrong answers, chapters' chapter.json and public tests, nothing of hidden/).
- README.md (the learner's, from scripts/student_README.md), pyproject.toml (whose
  ``python -m pytest`` runs the chapters' public tests), scripts/setup.sh, binder/, and
  results/ (the recorded GPU results the notebooks show; not the mutation runs).

Then it checks the result (``leaks``, ``instructor_only``): no line of a region's reference,
no solution text, no hidden test and no wrong answer anywhere in it (JSON records read as
the strings they hold), every region stubbed, no note addressed to maintainers and no path
of the instructor edition's hidden tests, wrong answers or solutions. A leaking edition
is deleted and the command exits 1.

Nothing is written into this repository but the edition itself (when ``--out`` is inside
it, as the default student/ is) and, when asked with ``--course-root``, the gradebook.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.dont_write_bytecode = True  # importing the judge's package must leave no __pycache__ in this repository
sys.path.insert(0, str(REPO / "practice"))  # the judge's package: regions and chapter registries
from judging import chapters as registry  # noqa: E402
from judging import regions  # noqa: E402

ASSIGNMENT = "notebooks"  # nbgrader's assignment: the folder notebooks/ (see nbgrader_config.py)
LIBRARY = ["course_lib", "pyproject.toml", "scripts/setup.sh", "binder", "results"]
STUDENT_README = REPO / "scripts" / "student_README.md"
MARKERS = ["BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"]
SECRET_NAMES = {"solution.py", "test_hidden.py", "nbgrader_config.py", "gradebook.db"}
# Notes written to the people who keep the course, not to learners: a size rule's excuse
# ("over 60 lines because ..."), a to-do, a note addressed to maintainers or instructors.
MAINTAINER_NOTE = re.compile(r"#.*\bover \d+ lines\b|#\s*(TODO|FIXME|XXX|HACK)\b"
                             r"|\bnotes? (to|for) (the )?(maintainers|instructors)\b", re.I)
# Where the instructor edition keeps what learners never get: hidden tests, wrong answers, solutions.
INSTRUCTOR_PATH = re.compile(r"(?<![\w.-])(hidden|wrong)/"
                             r"|\b(solution|test_hidden|test_differential|solution_twin)\.py\b"
                             r"|equivalent_mutants\.json|MUTANTS\.md")
# Files that may name those places: the judge looks for them there (and says so when absent);
# results/ holds recorded runs, whose logs name hidden cases.
MAY_NAME_PATHS = ("practice/judge.py", "practice/judging/", "results/")
# Recorded runs left out of the edition: mutation runs list each mutant's whole body, a
# reference answer with one line changed.
RESULTS_LEFT_OUT = ("mutate*", "wrong-bank*")


def course_config(course_root: Path | None = None, release_root: Path | None = None):
    """The instructor's nbgrader config (nbgrader_config.py), optionally with the gradebook
    and submissions under ``course_root`` and the student notebooks under ``release_root``."""
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(REPO)).load_config()
    if course_root is not None:
        course_root = Path(course_root).resolve()
        config.CourseDirectory.root = str(course_root)
        config.CourseDirectory.source_directory = str(REPO)  # absolute: still this repo's notebooks/
        config.CourseDirectory.db_url = f"sqlite:///{course_root / 'gradebook.db'}"
    if release_root is not None:
        config.CourseDirectory.release_directory = str(Path(release_root).resolve())
    return config


def nbgrader_api(config):
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    return NbGraderAPI(CourseDirectory(config=config), config=config)


def release_notebooks(dest: Path, course_root: Path | None = None) -> list[Path]:
    """nbgrader generate_assignment into ``dest``/notebooks; returns the notebooks written.
    The gradebook goes to ``course_root``, or to a temporary folder deleted afterwards."""
    with tempfile.TemporaryDirectory(prefix="release-gradebook-") as scratch:
        config = course_config(course_root or Path(scratch), dest)
        Path(config.CourseDirectory.root).mkdir(parents=True, exist_ok=True)
        result = nbgrader_api(config).generate_assignment(ASSIGNMENT, force=True)
    if not result["success"]:
        raise RuntimeError(f"nbgrader generate_assignment failed:\n{result['error']}\n{result['log']}")
    return sorted((dest / ASSIGNMENT).glob("*.ipynb"))


def release_practice(dest: Path) -> None:
    """The judge's own release step into ``dest``/practice (leaving no bytecode behind here)."""
    subprocess.run([sys.executable, str(REPO / "practice" / "judge.py"), "release", str(dest / "practice")],
                   check=True, cwd=REPO, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def copy_library(dest: Path) -> None:
    caches = ("__pycache__", "*.pyc", "*.egg-info")
    for name in LIBRARY:
        src, dst = REPO / name, dest / name
        if src.is_dir():
            left_out = RESULTS_LEFT_OUT if name == "results" else ()
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*caches, *left_out))
        elif src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    stub_library(dest)
    write_student_files(dest)


def stub_library(dest: Path, repo: Path = REPO) -> int:
    """Replace every region's body under ``dest``/course_lib by its stub; returns how many."""
    chapters = registry.all_chapters()
    problems = registry.consistency(repo, chapters)
    if problems:
        raise RuntimeError("exercise regions and chapter registries disagree:\n  " + "\n  ".join(problems))
    stubs = registry.stub_bodies(chapters)
    count = 0
    for path in regions.source_files(dest):
        text = path.read_text(encoding="utf-8")
        found = regions.parse(text, path)
        if found:
            path.write_text(regions.replace_bodies(text, stubs, path), encoding="utf-8")
            count += len(found)
    regions.mark_edition(dest, student=True)  # every region is a learner's now: no fast path stands in for one
    return count


def write_student_files(dest: Path) -> None:
    """The learner's README (chapter list from the registries) and a pyproject whose pytest runs the public tests."""
    rows = "\n".join(f"| {ch.id} | {ch.title} | {', '.join(f'`{e.id}`' for e in ch.exercises)} | `{ch.notebook}` | "
                     f"{', '.join(f'`{w}`' for w in ch.warmups) or '-'} |" for ch in registry.all_chapters())
    (dest / "README.md").write_text(STUDENT_README.read_text(encoding="utf-8").replace("{chapters}", rows),
                                    encoding="utf-8")
    pyproject = dest / "pyproject.toml"
    if pyproject.is_file():
        text = pyproject.read_text(encoding="utf-8")
        pyproject.write_text(text.replace('testpaths = ["tests"]', 'testpaths = ["practice/chapters"]'),
                             encoding="utf-8")


def unstubbed(edition: Path, repo: Path = REPO) -> list[str]:
    """Regions of ``repo`` that are not stubbed in ``edition`` (missing, or holding more than the stub)."""
    want = {r.id for r in regions.find(repo)}
    found = {r.id: r for r in regions.find(edition)}
    stubs = registry.stub_bodies(registry.all_chapters())
    out = [f"region {rid} is missing from the student edition" for rid in sorted(want - set(found))]
    for rid, r in sorted(found.items()):
        if r.code_lines() != [stubs.get(rid, "").strip()]:
            out.append(f"{r.path}:{r.begin + 1}: region {rid} is not stubbed")
    return out


def _lines(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines()}


def secret_lines(repo: Path = REPO) -> set[str]:
    """Lines that must never reach a learner: the lines of solution and hidden-test regions
    in the source notebooks, of the hidden chapter tests and of the practice solutions,
    less any line the learner sees anyway (the rest of the notebooks, starters, course_lib)."""
    secret, public = set(), set()
    region = re.compile(r"### BEGIN (SOLUTION|HIDDEN TESTS)\n(.*?)### END \1", re.S)
    for nb in sorted((repo / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            src = "".join(cell["source"])
            for _, body in region.findall(src):
                secret |= _lines(body)
            public |= _lines(region.sub("", src))
    for py in sorted((repo / "practice" / "hidden").rglob("*.py")):
        secret |= _lines(py.read_text())
    for solution in sorted((repo / "practice" / "problems").glob("*/solution.py")):
        secret |= _lines(solution.read_text())
        public |= {line for f in solution.parent.glob("*") if f.is_file() and f.name != "solution.py"
                   for line in _lines(f.read_text(errors="replace"))}
    outside = course_lib_outside_regions(repo)
    public |= {line for f in (repo / "practice" / "chapters").rglob("*") if f.is_file()
               for line in _lines(f.read_text(errors="replace"))}
    public |= outside
    # The judge itself ships to learners: a hidden helper sharing a line with it gives nothing away.
    public |= {line for f in [repo / "practice" / "judge.py", *(repo / "practice" / "judging").glob("*.py")]
               if f.is_file() for line in _lines(f.read_text(encoding="utf-8"))}
    # Short or generic lines ("return x", "import os") say nothing about an answer.
    hidden = {s for s in secret - public if len(s) >= 24 and not s.startswith(("#", '"""'))}
    # A region's reference: its distinctive lines, unless the learner sees the same line
    # outside every region of course_lib anyway (public tests do not excuse a line). The
    # same 24-character floor: "for phase in phases:" is plotting code in chapter 08 too;
    # a copied body of short lines is still caught whole by ``region_blocks``.
    reference = {line for r in regions.find(repo) for line in r.code_lines()}
    return hidden | {s for s in reference - outside if len(s) >= 24}


def course_lib_outside_regions(repo: Path = REPO) -> set[str]:
    """Lines of course_lib a learner sees: every file with the region bodies taken out."""
    out = set()
    for py in regions.source_files(repo):
        text = py.read_text(encoding="utf-8")
        bodies = {r.id: "pass\n" for r in regions.parse(text, py)}
        out |= _lines(regions.replace_bodies(text, bodies, py))
    return out


def region_blocks(repo: Path = REPO) -> dict[str, tuple[str, ...]]:
    """{region id: its code lines} for regions of two or more code lines: a copied body is a leak
    even where each line alone is too short or too common to say so."""
    return {r.id: tuple(r.code_lines()) for r in regions.find(repo) if len(r.code_lines()) >= 2}


def _contains_block(lines: list[str], block: tuple[str, ...]) -> bool:
    n = len(block)
    return any(tuple(lines[i:i + n]) == block for i, line in enumerate(lines) if line == block[0])


def _json_strings(text: str) -> list[str]:
    """Every string in a JSON document, or in each line of a JSON-lines file."""
    try:
        stack = [json.loads(text)]
    except json.JSONDecodeError:  # JSON lines: a document per line (an unparsable line holds none)
        stack = []
        for line in text.splitlines():
            try:
                stack.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    out = []
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    return out


def leaks(edition: Path, repo: Path = REPO) -> list[str]:
    """Everything in ``edition`` that gives away an answer or a hidden test (empty: clean)."""
    found = []
    secrets = secret_lines(repo)
    blocks = region_blocks(repo)
    for path in sorted(p for p in Path(edition).rglob("*") if p.is_file()):
        rel = path.relative_to(edition)
        if path.name in SECRET_NAMES or "hidden" in rel.parts or "wrong" in rel.parts:
            found.append(f"{rel}: a file that belongs to the instructor edition only")
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if path.suffix == ".ipynb":  # compare cell sources line by line, not JSON-escaped text
            text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
        elif path.suffix in (".json", ".jsonl"):  # and a record's strings as the lines they hold
            text += "\n" + "\n".join(_json_strings(text))
        found += [f"{rel}: contains the nbgrader marker {m!r}" for m in MARKERS if m in text]
        found += [f"{rel}: contains a line of a solution or hidden test: {s!r}" for s in sorted(secrets & _lines(text))]
        code = [s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#")]
        found += [f"{rel}: contains the reference body of region {rid}" for rid, b in blocks.items()
                  if _contains_block(code, b)]
    return found


def instructor_only(edition: Path) -> list[str]:
    """Every line in ``edition``'s text files that speaks to maintainers (``MAINTAINER_NOTE``)
    or names where the instructor edition keeps hidden tests, wrong answers and solutions
    (``INSTRUCTOR_PATH``; the judge's code and recorded results may). Empty: clean."""
    found = []
    for path in sorted(p for p in Path(edition).rglob("*") if p.is_file()):
        rel = path.relative_to(edition).as_posix()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue  # not text: nothing a learner reads
        if path.suffix == ".ipynb":  # the cells' own lines, not the JSON around them
            lines = [ln for c in json.loads("\n".join(lines))["cells"] for ln in "".join(c["source"]).splitlines()]
        for number, line in enumerate(lines, 1):
            if MAINTAINER_NOTE.search(line):
                found.append(f"{rel}:{number}: a note for maintainers: {line.strip()[:120]!r}")
            elif not rel.startswith(MAY_NAME_PATHS) and INSTRUCTOR_PATH.search(line):
                found.append(f"{rel}:{number}: names an instructor-only path: {line.strip()[:120]!r}")
    return found


def build(dest: Path, practice: bool = True, course_root: Path | None = None) -> dict:
    """Build and check the student edition in ``dest`` (replaced); returns a summary."""
    dest = Path(dest).resolve()
    if dest == REPO or (REPO in dest.parents and dest.relative_to(REPO).parts[0] != "student"):
        raise ValueError(f"{dest}: the student edition goes to student/ or outside this repository")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    notebooks = release_notebooks(dest, course_root)
    if practice:
        release_practice(dest)
    copy_library(dest)
    problems = unstubbed(dest) + leaks(dest) + instructor_only(dest)
    if problems:
        shutil.rmtree(dest)  # never leave a leaking edition behind
        raise RuntimeError("the student edition leaks answers (deleted):\n  " + "\n  ".join(problems))
    return {"dest": str(dest), "notebooks": [n.name for n in notebooks], "practice": practice,
            "regions": len(regions.find(dest)), "gradebook": str(Path(course_root).resolve() / "gradebook.db")
            if course_root else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", "--dest", dest="out", type=Path, default=REPO / "student",
                        help="output folder (replaced); default student/ (--dest is the same option)")
    parser.add_argument("--no-practice", action="store_true", help="leave out practice/ (the judge's release step)")
    parser.add_argument("--course-root", type=Path, default=None,
                        help="record the assignment in DIR/gradebook.db for nbgrader autograde (`grading` is the "
                             "folder nbgrader_config.py names); default: not recorded, nothing written here")
    args = parser.parse_args(argv)
    try:
        summary = build(args.out, practice=not args.no_practice, course_root=args.course_root)
    except (RuntimeError, ValueError, subprocess.CalledProcessError, regions.RegionError) as exc:
        print(f"release failed: {exc}", file=sys.stderr)
        return 1
    print(f"student edition in {summary['dest']}")
    print(f"  course_lib/: {summary['regions']} exercise regions stubbed")
    print(f"  notebooks/: {', '.join(summary['notebooks'])} (solutions and hidden tests removed)")
    print("  practice/: " + ("from practice/judge.py release" if summary["practice"] else "left out (--no-practice)"))
    print(f"  gradebook: the assignment recorded in {summary['gradebook']}" if summary["gradebook"] else
          "  gradebook: not recorded (to autograde with nbgrader later, build with --course-root grading)")
    print("  checked: every region stubbed; no reference line, no solution text, no hidden test, no instructor-only "
          "file, no note for maintainers, no instructor-only path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
