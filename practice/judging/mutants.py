"""Mutants of an exercise region's reference body, made with cosmic-ray's operators.

The tool: cosmic-ray (https://github.com/sixty-north/cosmic-ray), pinned in pyproject's
``[dev]`` extra. Of it the judge uses the operator set, as a library: every binary,
comparison, unary and boolean operator replaced by every other one it allows, ``not``
added to conditions, numbers moved by one, ``True`` / ``False`` and ``break`` /
``continue`` swapped, loops given no iterations. ``mutant_operators.py`` adds, in
cosmic-ray's own operator style, what it lacks: an operand dropped from ``and`` / ``or``,
``in`` / ``not in``, ``+=`` made ``=`` or ``-=``, string and ``None`` constants, keyword
arguments removed or given another value, ``except`` clauses that catch nothing, another
exception raised, return values replaced, a statement deleted.

Why not its runner: cosmic-ray's runner writes each mutant into the one source tree in
place, keeps a session database, and calls a mutant killed when a test command exits
non-zero. The judge needs each mutant graded as a learner's answer is: in its own copy of
course_lib marked as changed (so no fast path stands in for the region), the chapter's
public and hidden cases in a child process with a time limit, and "not graded here"
kept apart from a pass when a GPU case cannot run. Its operators also need nothing but
parso and attrs (pure Python), so the GPU machine, which has no package index, installs
them from ``.whl/``. mutmut 3 was the other candidate: its operators (``mutmut.mutation.
mutators``) work on libcst, a compiled package, and it has one replacement per operator
where cosmic-ray has them all; its runner switches mutants inside the imported module
(a trampoline), which cannot be graded as a learner's copy either.

A region's body is parsed with one fixed grammar (so every machine makes the same
mutants), each mutant printed back and compiled: one that does not compile is
"invalid" (listed, never graded), one whose syntax tree equals the reference's, or an
earlier mutant's, is dropped. A mutant is known by its region and the lines it changes,
as tokens (``key``): an edit elsewhere in the region leaves it the same mutant, which is
how ``hidden/chapters/equivalent_mutants.json`` names the ones shown equivalent.
"""
from __future__ import annotations

import ast
import difflib
import json
import random
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from judging import regions

GRAMMAR = "3.10"  # the oldest Python the course supports: the same mutants on every machine
EQUIVALENT = Path(__file__).resolve().parent.parent / "hidden" / "chapters" / "equivalent_mutants.json"
_WRAPPER = "def _region():\n"
# cosmic-ray operators left out: the two that need a maintainer to name variables, and the
# except-clause one, replaced by mutant_operators.ExceptClauseReplacer (see there).
_LEFT_OUT = {"VariableReplacer", "VariableInserter", "ExceptionReplacer"}


@dataclass
class Mutant:
    exercise: str
    operator: str
    line: int              # the first changed line, in the source file (1-based)
    before: str            # the reference's changed lines, stripped, one per line
    after: str             # the mutant's
    body: str = field(repr=False)   # the whole mutated body, at column 0
    valid: bool = True     # compiles (an invalid mutant is listed, never graded)

    @property
    def key(self) -> tuple[str, str, str]:
        return key(self.exercise, self.before, self.after)

    @property
    def diff(self) -> str:
        return "\n".join([f"- {s}" for s in self.before.splitlines()] + [f"+ {s}" for s in self.after.splitlines()])

    def to_json(self) -> dict:
        return {"exercise": self.exercise, "operator": self.operator, "line": self.line, "diff": self.diff,
                "before": self.before, "after": self.after}


_TOKEN = re.compile(r"""[rRbBuUfF]{0,2}(?:'''[\s\S]*?'''|\"\"\"[\s\S]*?\"\"\"|'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*")"""
                    r"|#[^\n]*|\w+|\S")


def normal(code: str) -> str:
    """``code`` as its tokens, one space apart, comments dropped: the same for two spellings
    of the same code (``dsts[ -1]`` and ``dsts[-1]``) on any Python version."""
    return " ".join(t for t in _TOKEN.findall(code) if not t.startswith("#"))


def key(exercise: str, before: str, after: str) -> tuple[str, str, str]:
    return exercise, normal(before), normal(after)


def operators() -> list[tuple[str, object]]:
    """(name, operator) for the full set: cosmic-ray's, then the judge's additions."""
    from cosmic_ray.operators.provider import OperatorProvider

    from judging.mutant_operators import JUDGE_OPERATORS

    provider = OperatorProvider()
    found = [(name, provider[name]()) for name in provider if name not in _LEFT_OUT]
    return found + [(cls.__name__, cls()) for cls in JUDGE_OPERATORS]


def _wrap(body: str) -> str:
    return _WRAPPER + "".join(("    " + ln if ln.strip() else "") + "\n" for ln in body.splitlines())


def _unwrap(code: str) -> str:
    lines = code.splitlines()[1:]
    return "\n".join(ln[4:] if ln.startswith("    ") else ln.strip() for ln in lines).rstrip("\n") + "\n"


def _tree_dump(code: str) -> str | None:
    """The syntax tree without positions, or None when ``code`` does not compile."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "is" with a literal, and the like: valid code
            compile(code, "<mutant>", "exec", dont_inherit=True)
        return ast.dump(ast.parse(code))
    except (SyntaxError, ValueError):
        return None


def _parse(code: str):
    import parso

    return parso.load_grammar(version=GRAMMAR).parse(code)


def _nodes(tree) -> list:
    from cosmic_ray.ast import ast_nodes

    return list(ast_nodes(tree))


def mutate_code(code: str, operator, node_index: int, occurrence: int) -> str:
    """``code`` with ``operator`` applied at its ``occurrence``-th position of the
    ``node_index``-th node (pre-order, as cosmic-ray walks a tree), in a fresh parse."""
    tree = _parse(code)
    node = _nodes(tree)[node_index]
    new = operator.mutate(node, occurrence)
    if new is not node:
        siblings = node.parent.children
        at = next(i for i, c in enumerate(siblings) if c is node)
        siblings[at:at + 1] = [] if new is None else [new]
    return tree.get_code()


def positions(code: str, operator, nodes=None) -> list[tuple[int, int]]:
    """(node index, occurrence) of every mutation ``operator`` can make in ``code``'s body
    (the wrapper's first line is not the region's)."""
    return [(i, k) for i, node in enumerate(_nodes(_parse(code)) if nodes is None else nodes)
            for k, (start, _end) in enumerate(operator.mutation_positions(node)) if start[0] > 1]


TOOLS = ("cosmic-ray", "oneline")


def mutants_of(region: regions.Region, tool: str = "cosmic-ray", ops=None) -> tuple[list[Mutant], int]:
    """Every mutant of ``region``'s body that ``tool`` makes, the invalid ones included
    (``valid`` False), in source order; and how many were dropped as equal to the reference
    or to an earlier mutant. ``oneline`` is the judge's earlier set (oneline_mutants.py),
    kept to repeat the runs recorded with it."""
    reference = regions.dedent_body(region)
    if tool == "cosmic-ray":
        candidates = _cosmic_ray_candidates(reference, ops)
    elif tool == "oneline":
        from judging.oneline_mutants import candidates as oneline
        candidates = oneline(reference)
    else:
        raise ValueError(f"no mutation tool {tool!r} (known: {', '.join(TOOLS)})")
    seen = {_tree_dump(_wrap(reference))}
    found, dropped = [], 0
    for name, body in candidates:
        dump = _tree_dump(_wrap(body))
        if dump in seen:
            dropped += 1
            continue
        if dump is not None:
            seen.add(dump)
        found.append(_mutant(region, name, reference, body, valid=dump is not None))
    found.sort(key=lambda m: m.line)  # stable: operators keep their order on a line
    return found, dropped


def _cosmic_ray_candidates(reference: str, ops=None):
    """(operator name, mutated body) for every position of every operator."""
    wrapped = _wrap(reference)
    nodes = _nodes(_parse(wrapped))  # only read: each mutant is made in a fresh parse
    for name, op in ops if ops is not None else operators():
        for node_index, occurrence in positions(wrapped, op, nodes):
            yield name, _unwrap(mutate_code(wrapped, op, node_index, occurrence))


def _mutant(region, operator: str, reference: str, body: str, valid: bool) -> Mutant:
    old, new = reference.splitlines(), body.splitlines()
    changed = [op for op in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes() if op[0] != "equal"]
    i1, j1 = changed[0][1], changed[0][3]
    i2, j2 = changed[-1][2], changed[-1][4]
    return Mutant(region.id, operator, region.begin + 2 + i1, "\n".join(s.strip() for s in old[i1:i2]),
                  "\n".join(s.strip() for s in new[j1:j2]), body, valid)


def draw(mutants: list[Mutant], per_region: int, seed: int) -> list[Mutant]:
    """Up to ``per_region`` valid mutants, drawn with ``seed`` (0: all), in source order."""
    valid = [m for m in mutants if m.valid]
    if per_region <= 0 or per_region >= len(valid):
        return valid
    picked = set(map(id, random.Random(seed).sample(valid, per_region)))
    return [m for m in valid if id(m) in picked]


def equivalent_mutants(path: Path = EQUIVALENT) -> dict[tuple[str, str, str], str]:
    """``key`` -> why that mutant is equivalent, from the registry (a list of
    ``{"exercise", "before", "after", "why"}``: the lines as the reference and the mutant have them)."""
    if not path.is_file():
        return {}
    return {key(e["exercise"], e["before"], e["after"]): e["why"] for e in json.loads(path.read_text(encoding="utf-8"))}
