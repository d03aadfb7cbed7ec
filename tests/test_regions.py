"""Exercise regions and chapter registries: the markers' rules, stubbing, and that the tree agrees with the registries."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "practice"))
from judging import chapters, regions  # noqa: E402

SOURCE = '''class A:
    def f(self, x):
        """Doc."""
        # BEGIN EXERCISE ch09.twice
        y = x * 2

        return y
        # END EXERCISE
'''


def test_parse_finds_the_body_and_its_indentation():
    (r,) = regions.parse(SOURCE, "a.py")
    assert (r.id, r.chapter, r.name, r.indent, r.begin, r.end) == ("ch09.twice", "ch09", "twice", " " * 8, 3, 7)
    assert r.code_lines() == ["y = x * 2", "return y"]
    assert regions.dedent_body(r) == "y = x * 2\n\nreturn y\n"


def test_a_stubbed_region_raises_its_message_and_keeps_the_markers():
    stub = regions.stub_line("ch09.twice", "ch09", "notebooks/09.ipynb", "Exercise 1 · Twice")
    text = regions.replace_bodies(SOURCE, {"ch09.twice": stub + "\n"})
    assert "# BEGIN EXERCISE ch09.twice" in text and "# END EXERCISE" in text and "y = x * 2" not in text
    ns: dict = {}
    exec(text, ns)
    with pytest.raises(NotImplementedError, match=r"ch09\.twice: write this part \(chapter 09, notebooks/09\.ipynb, "
                                                  r"section “Exercise 1 · Twice”\)"):
        ns["A"]().f(1)
    (r,) = regions.parse(text)  # the judge can find it again, and put a body back
    back = regions.replace_bodies(text, {r.id: "return x + x\n"})
    ns = {}
    exec(back, ns)
    assert ns["A"]().f(4) == 8 and "        return x + x\n" in back


def test_the_instructor_edition_runs_as_if_the_markers_were_absent():
    ns: dict = {}
    exec(SOURCE, ns)
    assert ns["A"]().f(3) == 6


@pytest.mark.parametrize("text, words", [
    ("# BEGIN EXERCISE ch01.a\nx = 1\n# BEGIN EXERCISE ch01.b\n", "regions do not nest"),
    ("# BEGIN EXERCISE ch01.a\nx = 1\n", "has no '# END EXERCISE' line"),
    ("x = 1\n# END EXERCISE\n", "without a BEGIN marker"),
    ("# BEGIN EXERCISE ch1.a\nx = 1\n# END EXERCISE\n", "must read '# BEGIN EXERCISE chNN.name'"),
    ("# BEGIN EXERCISE ch01.Name\nx = 1\n# END EXERCISE\n", "lower-case name"),
    ("# BEGIN EXERCISE\nx = 1\n# END EXERCISE\n", "must read"),
    ("# BEGIN EXERCISE ch01.a\nx = 1\n# END EXERCISE here\n", "must read exactly '# END EXERCISE'"),
    ("# BEGIN EXERCISE ch01.a\n# only a comment\n\n# END EXERCISE\n", "has no code between its markers"),
])
def test_broken_markers_are_errors_that_name_the_line(text, words):
    with pytest.raises(regions.RegionError, match="a.py:") as e:
        regions.parse(text, "a.py")
    assert words in str(e.value)


def test_ids_are_unique_across_the_tree(tmp_path):
    pkg = tmp_path / "course_lib"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    # BEGIN EXERCISE ch01.x\n    return 1\n    # END EXERCISE\n")
    (pkg / "b.py").write_text("def g():\n    # BEGIN EXERCISE ch01.x\n    return 2\n    # END EXERCISE\n")
    with pytest.raises(regions.RegionError, match="ch01.x is used twice"):
        regions.find(tmp_path)


def test_consistency_names_unregistered_regions_and_missing_ones(tmp_path):
    pkg = tmp_path / "course_lib"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    # BEGIN EXERCISE ch01.block_hash\n    return 1\n    # END EXERCISE\n"
                              "def g():\n    # BEGIN EXERCISE ch01.extra\n    return 2\n    # END EXERCISE\n")
    (ch01,) = [c for c in chapters.all_chapters() if c.id == "ch01"]
    fake = chapters.Chapter("ch01", ch01.path, "t", "n", [*ch01.exercises, chapters.Exercise("ch01.gone", "g", "s", 1)])
    problems = chapters.consistency(tmp_path, [fake])
    assert any("ch01.extra" in p and "in no chapter.json" in p for p in problems), problems
    assert any("ch01.gone" in p and "no region" in p for p in problems), problems
    assert any(p.startswith("ch01.block_hash is registered by both") for p in chapters.consistency(tmp_path, [fake, fake]))


def test_every_region_is_registered_once_and_every_exercise_is_a_region():
    assert chapters.consistency(REPO, chapters.all_chapters()) == []
    assert regions.find(REPO), "no exercise region in course_lib"


def test_chapter_json_is_checked(tmp_path):
    d = tmp_path / "ch02"
    d.mkdir()
    (d / "chapter.json").write_text('{"chapter": "ch02", "title": "t", "notebook": "n", '
                                    '"exercises": [{"id": "ch03.x", "title": "t", "section": "s", "points": 1}]}')
    with pytest.raises(ValueError, match="must read 'ch02.name'"):
        chapters.load("ch02", tmp_path)
    (d / "chapter.json").write_text('{"chapter": "ch02", "title": "t", "notebook": "n", '
                                    '"exercises": [{"id": "ch02.x", "title": "t", "section": "s", "points": 0}]}')
    with pytest.raises(ValueError, match="positive number"):
        chapters.load("ch02", tmp_path)
    with pytest.raises(KeyError, match="no chapter 'ch05'"):
        chapters.load("ch05", tmp_path)
