"""Every exercise in the chapter notebooks has its hints, and no hint gives the answer away.

For each exercise of each ``practice/chapters/chNN/chapter.json``: exactly one markdown cell
tagged ``hint`` between its section heading and the next exercise's heading, before the
exercise's check cell. It opens by saying a hint costs nothing in the grade, then holds two
or three ``<details>`` blocks (collapsed in JupyterLab, GitHub and nbviewer) whose summaries
read ``Hint k · <kind>``, k = 1, 2, ... and the kinds in the order idea, approach, tricky
detail; each hint is one to three sentences. A hint holds no line of a region's reference
body, no line of a hidden test or wrong answer, and no code block longer than one line.
The checks are run on a broken copy of a notebook too, so they are known to fail.
"""
from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HIDDEN = REPO / "practice" / "hidden" / "chapters"
REGISTRIES = sorted((REPO / "practice" / "chapters").glob("ch[0-9][0-9]/chapter.json"))
KINDS = ["the idea", "the approach", "the tricky detail"]
FREE = "costs nothing in the grade"
MIN_LINE = 25  # shorter lines ("return spans", "continue") say nothing about an answer
DETAILS = re.compile(r"<details><summary>(.*?)</summary>(.*?)</details>", re.S)
SUMMARY = re.compile(r"Hint (\d) · (.+)")


def registry(path: Path) -> dict:
    return json.loads(path.read_text())


def distinctive(text: str) -> set[str]:
    """Lines of ``text`` long enough to identify it, whitespace collapsed."""
    lines = {" ".join(line.split()) for line in text.splitlines()}
    return {s for s in lines if len(s) >= MIN_LINE and re.search(r"\w", s)}


def reference_lines() -> dict[str, str]:
    """{line: exercise id} for the distinctive lines of every region's reference body."""
    sys.path.insert(0, str(REPO / "practice"))
    from judging import regions

    return {line: r.id for r in regions.find(REPO) for line in distinctive("\n".join(r.code_lines()))}


def hidden_lines(chapter: str) -> set[str]:
    """The distinctive lines of a chapter's hidden tests and wrong answers."""
    return {line for py in sorted((HIDDEN / chapter).rglob("*.py")) for line in distinctive(py.read_text())}


def is_hint(cell: dict) -> bool:
    return "hint" in cell.get("metadata", {}).get("tags", [])


def sentences(text: str) -> int:
    prose = re.sub(r"`[^`]*`", "code", text)
    return len(re.findall(r"[.!?](?=\s|$)", prose.strip()))


def cell_problems(where: str, source: str, forbidden: dict[str, str]) -> list[str]:
    """What is wrong with one hint cell's text."""
    out = []
    first_line = source.splitlines()[0] if source else ""
    if FREE not in first_line:
        out.append(f"{where}: its first line must say that a hint {FREE}")
    blocks = DETAILS.findall(source)
    if source.count("<details") != len(blocks):
        out.append(f"{where}: a <details> block that is not '<details><summary>...</summary>...</details>'")
    if not 2 <= len(blocks) <= 3:
        out.append(f"{where}: {len(blocks)} hints; an exercise has 2 or 3")
    kinds = []
    for k, (summary, body) in enumerate(blocks, 1):
        m = SUMMARY.fullmatch(summary.strip())
        if not m or int(m[1]) != k or m[2] not in KINDS:
            out.append(f"{where}: hint {k}'s summary is {summary!r}, not 'Hint {k} · <one of {KINDS}>'")
            continue
        kinds.append(KINDS.index(m[2]))
        if not 1 <= sentences(body) <= 3:
            out.append(f"{where}: hint {k} has {sentences(body)} sentences; a hint has one to three")
    if kinds and (kinds != sorted(set(kinds)) or kinds[0] != 0 or kinds[-1] != len(KINDS) - 1):
        out.append(f"{where}: the hints are not in order (the idea first, the tricky detail last): "
                   f"{[KINDS[k] for k in kinds]}")
    for fence in re.findall(r"```[^\n]*\n(.*?)```", source, re.S):
        if len([line for line in fence.splitlines() if line.strip()]) > 1:
            out.append(f"{where}: a code block of more than one line")
    if re.search(r"^(    |\t)\S", source, re.M):
        out.append(f"{where}: an indented line (markdown shows it as a code block)")
    flat = " ".join(source.split())
    for line, owner in sorted(forbidden.items()):
        if line in flat:
            out.append(f"{where}: gives away a line of {owner}: {line!r}")
    return out


def hint_problems(notebook: Path, chapter: dict, forbidden: dict[str, str]) -> list[str]:
    """Everything wrong with the hints of one chapter notebook ([] when all is well)."""
    cells = json.loads(notebook.read_text())["cells"]
    exercises = chapter["exercises"]
    out = [f"{notebook.name}: cell {i} is tagged 'hint' but is not markdown"
           for i, c in enumerate(cells) if is_hint(c) and c["cell_type"] != "markdown"]
    heads = {}
    for ex in exercises:
        found = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                 and re.search(rf"^#+ {re.escape(ex['section'])}$", "".join(c["source"]), re.M)]
        if len(found) != 1:
            out.append(f"{notebook.name}: {len(found)} headings for {ex['section']!r}")
        else:
            heads[ex["id"]] = found[0]
    for ex in exercises:
        if ex["id"] not in heads:
            continue
        head = heads[ex["id"]]
        end = min([i for i in heads.values() if i > head], default=len(cells))
        mine = [i for i in range(head + 1, end) if is_hint(cells[i])]
        where = f"{notebook.name} {ex['id']}"
        if len(mine) != 1:
            out.append(f"{where}: {len(mine)} hint cells after {ex['section']!r} and before the next "
                       f"exercise; there must be exactly one")
            continue
        (at,) = mine
        name = ex["id"].split(".", 1)[1]
        check = [i for i in range(head + 1, end) if cells[i]["cell_type"] == "code"
                 and f'public_checks("{name}")' in "".join(cells[i]["source"])]
        if check and at > check[0]:
            out.append(f"{where}: the hint cell comes after its check cell")
        if cells[at].get("metadata") != {"tags": ["hint"]}:
            out.append(f"{where}: the hint cell's metadata must be exactly {{'tags': ['hint']}} "
                       f"(no nbgrader): {cells[at].get('metadata')}")
        out += cell_problems(where, "".join(cells[at]["source"]), forbidden)
    hints = sum(is_hint(c) for c in cells)
    if hints != len(exercises):
        out.append(f"{notebook.name}: {hints} hint cells for {len(exercises)} exercises")
    return out


@pytest.fixture(scope="module")
def references():
    return {line: f"the reference of {rid}" for line, rid in reference_lines().items()}


def test_there_are_chapters_with_exercises():
    assert REGISTRIES and all(registry(p)["exercises"] for p in REGISTRIES)


@pytest.mark.parametrize("path", REGISTRIES, ids=lambda p: p.parent.name)
def test_every_exercise_has_graded_hints_that_give_no_answer(path, references):
    chapter = registry(path)
    assert hint_problems(REPO / chapter["notebook"], chapter, references) == []


@pytest.mark.parametrize("path", REGISTRIES, ids=lambda p: p.parent.name)
def test_no_hint_repeats_a_hidden_test_or_a_wrong_answer(path):
    if not (HIDDEN / path.parent.name).is_dir():
        pytest.skip(f"no hidden tests for {path.parent.name} in this edition")
    chapter = registry(path)
    forbidden = {line: f"{path.parent.name}'s hidden tests" for line in hidden_lines(path.parent.name)}
    assert forbidden
    problems = hint_problems(REPO / chapter["notebook"], chapter, forbidden)
    assert [p for p in problems if "gives away" in p] == []


def _hint_indices(nb: dict) -> list[int]:
    return [i for i, c in enumerate(nb["cells"]) if is_hint(c)]


def _set_source(cell: dict, text: str) -> None:
    cell["source"] = text.splitlines(keepends=True)


def test_the_checks_fail_on_a_broken_notebook(tmp_path, references):
    """Each way of breaking a hint cell, made in a copy of chapter 02, is reported."""
    path = REPO / "practice" / "chapters" / "ch02" / "chapter.json"
    chapter = registry(path)
    original = json.loads((REPO / chapter["notebook"]).read_text())
    sys.path.insert(0, str(REPO / "practice"))
    from judging import regions

    spans = next(r for r in regions.find(REPO) if r.id == "ch02.versions")
    answer = max(spans.code_lines(), key=len)
    hidden = sorted(hidden_lines("ch02"), key=len)[-1] if (HIDDEN / "ch02").is_dir() else None

    def first_hint(nb):
        return nb["cells"][_hint_indices(nb)[0]]

    def text(nb):
        return "".join(first_hint(nb)["source"])

    def drop(nb):
        del nb["cells"][_hint_indices(nb)[0]]

    def duplicate(nb):
        i = _hint_indices(nb)[0]
        nb["cells"].insert(i, dict(copy.deepcopy(nb["cells"][i]), id="dup-hint"))

    def after_the_check(nb):
        i = _hint_indices(nb)[0]
        cell = nb["cells"].pop(i)
        check = next(j for j in range(i, len(nb["cells"])) if "public_checks(" in "".join(nb["cells"][j]["source"]))
        nb["cells"].insert(check + 1, cell)

    def swap_order(nb):
        _set_source(first_hint(nb), text(nb).replace("Hint 1 · the idea", "Hint 1 · the approach", 1)
                    .replace("Hint 2 · the approach", "Hint 2 · the idea", 1))

    def renumber(nb):
        _set_source(first_hint(nb), text(nb).replace("Hint 2 ·", "Hint 3 ·", 1))

    def one_hint_only(nb):
        src = text(nb)
        _set_source(first_hint(nb), src[:src.index("<details", src.index("</details>"))].rstrip())

    def four_hints(nb):
        block = text(nb)[text(nb).rindex("<details"):]
        _set_source(first_hint(nb), text(nb) + "\n\n" + block.replace("Hint 3", "Hint 4"))

    def the_answer(nb):
        _set_source(first_hint(nb), text(nb).replace("</details>", f"Write `{answer}`.\n</details>", 1))

    def code_block(nb):
        _set_source(first_hint(nb), text(nb).replace("</details>", "\n```\nfor v in versions:\n    ...\n```\n</details>", 1))

    def indented_code(nb):
        _set_source(first_hint(nb), text(nb).replace("</details>", "\n    spans.append(v)\n</details>", 1))

    def nbgrader_metadata(nb):
        first_hint(nb)["metadata"]["nbgrader"] = {"grade": False, "locked": True, "solution": False}

    def no_free_line(nb):
        _set_source(first_hint(nb), text(nb).split("\n", 1)[1])

    def long_hint(nb):
        _set_source(first_hint(nb), text(nb).replace("</details>", "One. Two. Three. Four.\n</details>", 1))

    def code_cell(nb):
        first_hint(nb)["cell_type"] = "code"

    breakages = {
        drop: "0 hint cells", duplicate: "2 hint cells", after_the_check: "after its check cell",
        swap_order: "not in order", renumber: "summary is", one_hint_only: "1 hints",
        four_hints: "4 hints", the_answer: "gives away a line of the reference of ch02.versions",
        code_block: "code block", indented_code: "indented line", nbgrader_metadata: "no nbgrader",
        no_free_line: FREE, long_hint: "sentences", code_cell: "is not markdown",
    }
    forbidden = dict(references)
    if hidden:
        forbidden[hidden] = "ch02's hidden tests"
        breakages[lambda nb: _set_source(first_hint(nb), text(nb).replace("</details>", hidden + "\n</details>", 1))] = \
            "gives away a line of ch02's hidden tests"

    def problems_of(nb, name):
        copy_path = tmp_path / name / Path(chapter["notebook"]).name
        copy_path.parent.mkdir()
        copy_path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        return hint_problems(copy_path, chapter, forbidden)

    assert problems_of(copy.deepcopy(original), "intact") == []  # the copy itself is sound
    for n, (breakage, expected) in enumerate(breakages.items()):
        broken = copy.deepcopy(original)
        breakage(broken)
        found = problems_of(broken, f"broken{n}")
        assert any(expected in p for p in found), (getattr(breakage, "__name__", "hidden"), expected, found)


def test_the_hints_survive_into_the_student_edition(student_edition):
    """nbgrader's generate_assignment (scripts/release.py) keeps every hint cell as it is."""
    pytest.importorskip("nbgrader")
    released = {p.name: p for p in (student_edition.edition / "notebooks").glob("*.ipynb")}
    for path in REGISTRIES:
        name = Path(registry(path)["notebook"]).name
        want = ["".join(c["source"]) for c in json.loads((REPO / "notebooks" / name).read_text())["cells"] if is_hint(c)]
        got = ["".join(c["source"]) for c in json.loads(released[name].read_text())["cells"] if is_hint(c)]
        assert want and got == want, name
