"""The student edition (scripts/release.py): every region stubbed, nothing secret shipped, and a learner's walk.

Built once into a temporary folder (tests/conftest.py's ``student_edition``, shared with
tests/test_nbgrader.py and tests/test_hints.py); the learner's walk runs the student edition's own
judge: chapter 01 fails with the stub's message, then passes once the region is filled
back with the reference.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nbgrader")

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("course_release", REPO / "scripts" / "release.py")
release = importlib.util.module_from_spec(spec)
spec.loader.exec_module(release)
regions, registry = release.regions, release.registry


@pytest.fixture(scope="module")
def edition(student_edition):
    """The edition built by scripts/release.py (once per run, tests/conftest.py); the tests
    here copy it before they change anything."""
    return student_edition.edition


def judge(edition_root, *args, root=None, env=None):
    e = {k: v for k, v in os.environ.items() if k not in ("COURSE_HIDDEN_DIR", "PYTHONPATH")}
    e.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, str(edition_root / "practice" / "judge.py"), *args] + (["--root", str(root)] if root else [])
    return subprocess.run(cmd, cwd=edition_root, env=e, capture_output=True, text=True, timeout=300)


def test_every_region_is_stubbed_with_its_message(edition):
    found = {r.id: r for r in regions.find(edition)}
    assert set(found) == {r.id for r in regions.find(REPO)}
    assert release.unstubbed(edition) == []
    for ch in registry.all_chapters():
        for ex in ch.exercises:
            (line,) = found[ex.id].code_lines()
            assert line.startswith("raise NotImplementedError(") and ex.id in line
            assert f"chapter {ch.number}" in line and ch.notebook in line and ex.section in line


def test_nothing_secret_ships_and_the_public_parts_do(edition):
    assert release.leaks(edition) == []
    files = {p.relative_to(edition).as_posix() for p in edition.rglob("*") if p.is_file()}
    assert not [f for f in files if "hidden" in f.split("/") or "wrong" in f.split("/") or f.endswith("solution.py")]
    for ch in registry.all_chapters():
        assert {f"practice/chapters/{ch.id}/chapter.json", f"practice/chapters/{ch.id}/test_public.py"} <= files
    assert any(f.startswith("results/") for f in files), "the recorded GPU results are missing"
    readme = (edition / "README.md").read_text()
    assert "student edition" in readme and readme.index("scripts/setup.sh") < readme.index("jupyter lab notebooks/") \
        < readme.index("python practice/judge.py test ch01")
    assert 'testpaths = ["practice/chapters"]' in (edition / "pyproject.toml").read_text()


def test_leaks_are_refused(edition, tmp_path):
    fake = tmp_path / "edition"
    shutil.copytree(edition / "course_lib", fake / "course_lib")
    assert release.leaks(fake) == []
    (region,) = [r for r in regions.find(REPO) if r.id == "ch01.block_hash"]
    target = fake / region.path.relative_to(REPO)
    target.write_text(regions.replace_bodies(target.read_text(), {region.id: regions.dedent_body(region)}))
    assert any("ch01.block_hash is not stubbed" in p for p in release.unstubbed(fake))
    found = "\n".join(release.leaks(fake))
    assert region.code_lines()[0] in found, found
    (fake / "notes.txt").write_text((REPO / "practice/hidden/chapters/ch01/wrong/block_hash.no_chain.py").read_text())
    (fake / "extra").mkdir()
    shutil.copy(REPO / "practice/hidden/chapters/ch01/test_hidden.py", fake / "extra" / "copied.py")
    found = "\n".join(release.leaks(fake))
    assert "notes.txt: contains a line" in found and "extra/copied.py: contains a line" in found


def test_a_copied_multiline_body_is_a_leak_even_of_short_lines(tmp_path):
    repo = tmp_path / "repo"
    (repo / "course_lib").mkdir(parents=True)
    (repo / "course_lib" / "m.py").write_text("def f(x):\n    # BEGIN EXERCISE ch01.f\n    y = x\n    return y\n"
                                              "    # END EXERCISE\n")
    (tmp_path / "ed").mkdir()
    (tmp_path / "ed" / "copy.py").write_text("def g(x):\n    y = x\n    # a comment in between\n    return y\n")
    assert release.leaks(tmp_path / "ed", repo) == ["copy.py: contains the reference body of region ch01.f"]
    (tmp_path / "ed" / "copy.py").write_text("def g(x):\n    y = x\n    z = 1\n    return y\n")
    assert release.leaks(tmp_path / "ed", repo) == []


# What a copy of this repository leaves out: git's folder, caches, and the git-ignored
# outputs at its top (.gitignore), which a release may (re)write when asked.
COPY_SKIPS = {".git", "__pycache__", ".pytest_cache", ".ipynb_checkpoints"}
TOP_SKIPS = {"student", "grading", "workspace", "build", "dist", ".whl", "gpu-latest"}


def _copy_skips(folder, names):
    top = Path(folder).resolve() == REPO
    return [n for n in names if n in COPY_SKIPS or n.endswith((".pyc", ".egg-info")) or (top and n in TOP_SKIPS)]


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(root.rglob("*"))}


@pytest.mark.slow  # builds the whole edition once more, from a copy of this repository
def test_a_release_writes_nothing_into_the_instructors_tree(tmp_path):
    """Built without --course-root, the student edition leaves the instructor's tree exactly
    as it was: nbgrader's gradebook goes to a temporary folder, and no bytecode is written
    (the run is made as a Python that writes bytecode by default would make it)."""
    repo = tmp_path / "instructor"
    shutil.copytree(REPO, repo, ignore=_copy_skips)
    before = _tree(repo)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    run = subprocess.run([sys.executable, str(repo / "scripts" / "release.py"), "--out", str(tmp_path / "student")],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "student" / "course_lib" / "__init__.py").is_file() and "gradebook: not recorded" in run.stdout
    after = _tree(repo)
    added, removed = sorted(set(after) - set(before)), sorted(set(before) - set(after))
    changed = sorted(p for p in set(before) & set(after) if before[p] != after[p])
    assert not (added or removed or changed), f"written into the instructor's tree: {added[:5]}, removed: " \
                                              f"{removed[:5]}, changed: {changed[:5]}"


def test_nothing_for_instructors_or_maintainers_ships(edition):
    """Every shipped file is read: no note addressed to maintainers, no path of the instructor
    edition's hidden tests, wrong answers or solutions (outside the judge's code and the
    recorded results); practice/README.md stops where its instructors' part starts; no
    mutation record (each mutant is a reference answer with one line changed)."""
    assert release.instructor_only(edition) == []
    readme = (edition / "practice" / "README.md").read_text()
    assert "## Practice problems" in readme and "## For instructors" not in readme and "hidden/" not in readme
    assert not list((edition / "results").rglob("mutate*")) and list((REPO / "results").rglob("mutate*"))


def test_notes_for_maintainers_and_instructor_paths_are_refused(tmp_path):
    ed = tmp_path / "edition"
    for rel, text in {
        "course_lib/a.py": "x = 1\n# Over 60 lines because its docstring is long.\n# TODO: tidy\n# for learners\n",
        "README.md": "Read practice/hidden/chapters/ch01/test_hidden.py and wrong/x.py.\nNotes for maintainers: ...\n",
        "practice/judging/chapters.py": "HIDDEN = 'practice/hidden/chapters'\n",  # the judge looks there
        "results/run/judge_check.log": "test_hidden.py::test_case ... pass\n",  # a recorded run
    }.items():
        (ed / rel).parent.mkdir(parents=True, exist_ok=True)
        (ed / rel).write_text(text)
    cell = {"cell_type": "code", "metadata": {}, "source": ["# solution.py holds the answer\n", "x = 1\n"]}
    (ed / "notebooks").mkdir()
    (ed / "notebooks" / "00.ipynb").write_text(json.dumps({"cells": [cell], "metadata": {}}))
    found = release.instructor_only(ed)
    assert [f.split(": ")[0] + ": " + f.split(": ")[1] for f in found] == [
        "README.md:1: names an instructor-only path", "README.md:2: a note for maintainers",
        "course_lib/a.py:2: a note for maintainers", "course_lib/a.py:3: a note for maintainers",
        "notebooks/00.ipynb:1: names an instructor-only path"], found


def test_a_reference_body_inside_a_json_record_is_a_leak(tmp_path):
    repo = tmp_path / "repo"
    (repo / "course_lib").mkdir(parents=True)
    (repo / "course_lib" / "m.py").write_text("def f(x):\n    # BEGIN EXERCISE ch01.f\n    y = x\n    return y\n"
                                              "    # END EXERCISE\n")
    (tmp_path / "ed" / "results").mkdir(parents=True)
    record = tmp_path / "ed" / "results" / "mutants.jsonl"
    record.write_text(json.dumps({"mutants": [{"body": "y = x\nreturn y\n"}]}) + "\n")
    found = release.leaks(tmp_path / "ed", repo)
    assert found == ["results/mutants.jsonl: contains the reference body of region ch01.f"], found
    record.write_text(json.dumps({"mutants": [{"body": "y = x + 1\nreturn y\n"}]}) + "\n")
    assert release.leaks(tmp_path / "ed", repo) == []


def test_the_student_edition_imports(edition):
    run = subprocess.run([sys.executable, "-c", "import course_lib, course_lib.engine.block_manager as m; "
                          "print(course_lib.__file__)"], cwd=edition, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(edition)}, timeout=120)
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()).resolve().is_relative_to(edition.resolve())


def test_learner_walk_stub_then_reference(edition, tmp_path):
    """A learner's walk through chapter 01 in the student edition: the stub's message and exit 1;
    every chapter 01 region filled back from the reference (and the notebook's warm-up answered):
    exit 0 on the public tests, exit 0 on the instructor's hidden ones too, and the chapter's
    notebook runs top to bottom with no error, its graded cells passing on the learner's engine."""
    work = tmp_path / "learner"
    shutil.copytree(edition, work, ignore=shutil.ignore_patterns("binder"))
    before = judge(work, "test", "ch01", root=work)
    assert before.returncode == 1, before.stdout + before.stderr
    assert "ch01.block_hash: write this part (chapter 01, notebooks/01_the_engine.ipynb" in before.stdout
    assert "hidden tests: not present in this edition" in before.stdout

    chapter01 = [r for r in regions.find(REPO) if r.id.startswith("ch01.")]
    assert len(chapter01) >= 2
    fill_regions(work, {r.id for r in chapter01})
    after = judge(work, "test", "ch01", root=work)
    assert after.returncode == 0, after.stdout + after.stderr
    assert "status: complete" in after.stdout
    graded = judge(REPO, "test", "ch01", "--json", root=work)  # the instructor's judge: hidden tests too
    assert graded.returncode == 0, graded.stdout + graded.stderr
    result = json.loads(graded.stdout)
    assert result["hidden"] and result["points"] == result["max_points"] > 0
    assert any(c["case"].startswith("test_hidden.py::") for c in result["cases"])

    nb = run_learners_notebook(work, "01_the_engine.ipynb")
    shown = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert f"from {work}, torch" in shown, "the notebook ran another course_lib than the learner's"
    graded_out = "\n".join(o.get("text", "") for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")
                           for o in c.outputs)
    assert f"graded in {work} (public tests)" in graded_out, graded_out[-2000:]
    for region in chapter01:
        assert f"{region.id}: every case ran and passed" in graded_out, (region.id, graded_out[-2000:])


def run_learners_notebook(work: Path, name: str):
    """Run notebook ``name`` of the edition at ``work`` as its learner would: the kernel imports
    the learner's course_lib (as after set-up), the notebook's own warm-up answers written in.
    Returns the executed notebook; raises (naming the cell) on the first error."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    path = work / "notebooks" / name
    nb = nbformat.read(path, as_version=4)
    instructor = {c.metadata.get("nbgrader", {}).get("grade_id"): c.source
                  for c in nbformat.read(REPO / "notebooks" / name, as_version=4).cells}
    for cell in nb.cells:  # the notebook's own (non-engine) answers, as the learner writes them
        if cell.metadata.get("nbgrader", {}).get("solution"):
            cell.source = instructor[cell.metadata["nbgrader"]["grade_id"]]
    env_saved = {k: os.environ.pop(k) for k in ("COURSE_HIDDEN_DIR", "COURSE_PRACTICE_DIR", "PYTHONPATH")
                 if k in os.environ}
    os.environ["PYTHONPATH"] = str(work)
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        os.environ.pop("PYTHONPATH")
        os.environ.update(env_saved)
    import torch

    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.output_type != "error":
                continue
            # a graded cell whose exercise has GPU cases scores 0 on a CPU by design; nothing else may fail
            gpu_only = (cell.metadata.get("nbgrader", {}).get("grade") and not torch.cuda.is_available()
                        and "need a GPU" in o.evalue)
            assert gpu_only, f"{name}: a cell failed: {o.ename}: {o.evalue[:500]}"
    return nb


def fill_regions(work: Path, ids) -> None:
    """Write the reference body back into each region of ``ids`` in the edition at ``work``."""
    for region in regions.find(REPO):
        if region.id in ids:
            target = work / region.path.relative_to(REPO)
            target.write_text(regions.replace_bodies(target.read_text(), {region.id: regions.dedent_body(region)}))


@pytest.mark.slow
@pytest.mark.parametrize("chapter", [ch.id for ch in registry.all_chapters()])
def test_each_chapter_needs_only_its_own_and_earlier_parts(edition, tmp_path, chapter):
    """With the earlier chapters written and this one not, this chapter fails at its stubs
    (exit 1); once its parts are written too, and no later chapter's, it passes its public
    and hidden cases: no later chapter's stub is on its path."""
    work = tmp_path / "learner"
    shutil.copytree(edition, work, ignore=shutil.ignore_patterns("notebooks", "results", "binder"))
    # Earlier chapters written, this one not yet: this chapter fails, with its own stubs' messages.
    fill_regions(work, {ex.id for ch in registry.all_chapters() if ch.id < chapter for ex in ch.exercises})
    before = judge(work, "test", chapter, root=work)
    assert before.returncode == 1 and f"{chapter}." in before.stdout and ": write this part (chapter " in before.stdout
    fill_regions(work, {ex.id for ch in registry.all_chapters() if ch.id == chapter for ex in ch.exercises})
    graded = judge(REPO, "test", chapter, "--json", root=work)
    result = json.loads(graded.stdout)
    failed = [(c["case"], c["message"][:300]) for c in result["cases"] if c["outcome"] == "fail"]
    assert graded.returncode in (0, 3) and not failed and result["hidden"], failed or graded.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ten chapters stubbed, then graded, then ten notebooks: ~10 minutes on 2 cores
def test_whole_course_walk(edition, tmp_path):
    """The learner's walk through the whole course: with every region written (the reference),
    every chapter passes its public and hidden cases and every notebook runs top to bottom on
    the learner's engine; with any one chapter's regions left as stubs (all others written),
    that chapter's check fails with its own stub's message."""
    work = tmp_path / "learner"
    shutil.copytree(edition, work, ignore=shutil.ignore_patterns("binder"))
    chapters = registry.all_chapters()
    assert len(chapters) == 10
    for chapter in chapters:
        fill_regions(work, {ex.id for ch in chapters if ch.id != chapter.id for ex in ch.exercises})
        stubbed = judge(work, "test", chapter.id, root=work)
        assert stubbed.returncode == 1, (chapter.id, stubbed.stdout[-2000:])
        assert f"{chapter.id}." in stubbed.stdout and ": write this part (chapter " in stubbed.stdout, chapter.id
        shutil.rmtree(work / "course_lib")
        shutil.copytree(edition / "course_lib", work / "course_lib")
    fill_regions(work, {ex.id for ch in chapters for ex in ch.exercises})
    for chapter in chapters:
        graded = judge(REPO, "test", chapter.id, "--json", root=work)
        result = json.loads(graded.stdout)
        failed = [(c["case"], c["message"][:300]) for c in result["cases"] if c["outcome"] == "fail"]
        assert graded.returncode in (0, 3) and not failed and result["hidden"], (chapter.id, failed)
    for chapter in chapters:
        nb = run_learners_notebook(work, Path(chapter.notebook).name)
        graded_out = "\n".join(o.get("text", "") for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")
                               for o in c.outputs)
        for ex in chapter.exercises:
            assert f"{ex.id}: graded in {work}" in graded_out, (ex.id, graded_out[-1500:])
