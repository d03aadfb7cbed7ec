"""The README is the front door: its map of the code and its contracts table must name
files, functions and tests that exist, so a reader who follows them never hits a dead end."""
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def test_every_module_of_course_lib_is_on_the_map():
    mapped = section("Map of the code")
    missing = []
    for path in sorted((REPO / "course_lib").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if path.name == "__init__.py" and rel != "course_lib/__init__.py":
            continue
        # a module is mapped by its own row, or by its folder's row (``course_lib/rl/``)
        folders = [p.as_posix() + "/" for p in path.relative_to(REPO).parents if p.as_posix() != "."]
        if f"`{rel}`" not in mapped and not any(f"`{f}`" in mapped for f in folders) \
                and path.name not in mapped:
            missing.append(rel)
    assert not missing, f"modules missing from the README's map of the code: {missing}"


def test_every_mapped_path_exists():
    mapped = section("Map of the code")
    paths = re.findall(r"^\| `([^`]+)`", mapped, flags=re.M)
    assert paths, "the map of the code has no rows"
    absent = [p for p in paths if not (REPO / p).exists()]
    assert not absent, f"the README's map names paths that do not exist: {absent}"


def test_the_contracts_table_names_tests_and_files_that_exist():
    table = section("The contracts, where they are kept and proved")
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| contract")]
    assert len(rows) >= 6, "one row per contract: hot == cold, addresses, validate-then-commit, pauses, versions, timing"
    tests_dir = REPO / "tests"
    for row in rows:
        files = re.findall(r"`((?:course_lib/)?[\w/]+\.py)`|\(`([\w/]+\.py)`", row)
        named_tests = re.findall(r"`(?:tests/[\w/]+\.py)?::(test_\w+)`", row)
        assert named_tests, f"this contract names no test: {row[:80]}"
        for test in named_tests:
            assert any(f"def {test}(" in p.read_text() for p in tests_dir.glob("test_*.py")), \
                f"the contracts table names {test}, which no test file defines"
        for found in files:
            name = next(f for f in found if f)
            candidates = [REPO / name, REPO / "course_lib" / name]
            assert any(c.exists() for c in candidates), f"the contracts table names {name}, which does not exist"


def test_the_chapters_table_names_every_exercise():
    """The README's chapter table lists, per chapter, every exercise of its chapter.json."""
    text = README
    for registry in sorted((REPO / "practice" / "chapters").glob("ch*/chapter.json")):
        number = registry.parent.name.removeprefix("ch")
        row = next((r for r in text.splitlines() if r.startswith(f"| {number} | ")), None)
        assert row, f"the README's chapter table has no row for chapter {number}"
        for ex in json.loads(registry.read_text())["exercises"]:
            name = ex["id"].split(".", 1)[1]
            assert f"`{name}`" in row, f"chapter {number}'s row does not name its exercise {ex['id']}"
