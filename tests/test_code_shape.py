"""The shape of the code, kept: no import circle, no file of the engine or the update side
over 400 lines, no function over 60 lines, and no path to a ``course_lib`` file that does not
exist (a reader following a name in a docstring, a notebook or a test finds the file)."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "course_lib"
ROOMS = ("engine", "update", "weights", "server", "layers", "bench", "rl", "sim", "models")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from a import b``: the module a.b where b is one, else a itself.
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(files)) - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def room_of(module: str, depth: int) -> str:
    parts = module.split(".")
    return ".".join(parts[:depth + 1]) if len(parts) > depth + 1 else module


def test_no_import_circle_between_files_or_rooms():
    graph = import_graph()
    assert not cycles(graph), f"modules that import each other: {cycles(graph)}"
    for depth in (1, 2):  # course_lib.X, then course_lib.weights.X
        rooms: dict[str, set[str]] = {}
        for module, targets in graph.items():
            here = room_of(module, depth)
            rooms.setdefault(here, set()).update(room_of(t, depth) for t in targets if room_of(t, depth) != here)
        assert not cycles(rooms), f"rooms that import each other: {cycles(rooms)}"


def test_the_update_side_does_not_reach_up_into_the_engine():
    graph = import_graph()
    up = sorted((m, t) for m, ts in graph.items() if m.startswith(("course_lib.update", "course_lib.weights"))
                for t in ts if t.startswith(("course_lib.engine", "course_lib.server")))
    assert not up, f"imports that run up a layer: {up}"


def test_no_file_of_the_engine_or_the_update_side_is_over_400_lines():
    rooms = [PACKAGE / "engine", PACKAGE / "update", PACKAGE / "weights" / "commit"]
    long = [(str(p.relative_to(REPO)), n) for room in rooms for p in sorted(room.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400]
    assert not long, f"files over 400 lines: {long}"


def test_no_function_is_over_60_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 60 lines:\n" + "\n".join(long)


# A path into the package, written whole (course_lib/weights/commit/audit.py) or from one of
# its rooms (``weights/commit/audit.py``, ``update/writers.py``), to a file or a folder.
PATH = re.compile(r"(?<![\w/.-])(?:course_lib/)?(?:" + "|".join(ROOMS) + r")/[\w/]*\w(?:\.py)?(?![\w/])")
SCANNED = ("course_lib", "tests", "practice", "notebooks", "scripts")


def named_paths(text: str):
    for match in PATH.finditer(text):
        yield match.group(0)


def test_every_course_lib_path_named_in_code_notebooks_tests_and_docs_exists():
    files = [REPO / "README.md", REPO / "practice" / "README.md"]
    for where in SCANNED:
        files += [p for p in (REPO / where).rglob("*") if p.suffix in (".py", ".ipynb", ".md", ".json", ".sh")]
    stale = set()
    for path in files:
        if "__pycache__" in path.parts or path.name == Path(__file__).name:
            continue
        for name in named_paths(path.read_text(encoding="utf-8")):
            target = REPO / name if name.startswith("course_lib/") else PACKAGE / name
            if not target.exists() and not (target.parent.exists() and name.endswith("/")):
                stale.add(f"{path.relative_to(REPO)}: {name}")
    assert not stale, "paths that name no file of the package:\n" + "\n".join(sorted(stale))


def test_the_stale_path_check_can_fail():
    names = list(named_paths("see ``engine/transaction.py`` and course_lib/weights/reshard.py, not tests/x.py"))
    assert names == ["engine/transaction.py", "course_lib/weights/reshard.py"]
    assert not (PACKAGE / "engine" / "transaction.py").exists()
