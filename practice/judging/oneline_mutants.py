"""The judge's earlier, home-made mutants (``judge.py mutate --tool oneline``): one line of
a region's body changed by a text swap, kept so that the runs recorded with it in
``results/`` can be repeated. The full operator set is cosmic-ray's (``mutants.py``).

A line is deleted (``pass`` in its place), or one operator, comparison, boolean,
constant or slice bound on it swapped for a neighbouring one (``<`` for ``<=``, ``and``
for ``or``, ``n`` for ``n + 1``, ...), the first match on the line, outside strings and
comments.
"""
from __future__ import annotations

import re

# Token swaps: each pattern's match is replaced by its partner (the first match on the line).
SWAPS = [(" == ", " != "), (" != ", " == "), (" <= ", " < "), (" >= ", " > "), (" < ", " <= "), (" > ", " >= "),
         (" and ", " or "), (" or ", " and "), ("True", "False"), ("False", "True"), (" + ", " - "),
         (" - ", " + "), (" * ", " // "), ("not ", ""), ("[:", "[1:"), ("[-1]", "[0]"), ("[0]", "[-1]")]
_NUMBER = re.compile(r"(?<![\w.])(\d+)(?![\w.])")


def _in_code(line: str, at: int) -> bool:
    """Whether position ``at`` of ``line`` is code: outside string literals and before a
    comment (a swap inside a message or a comment changes nothing a test could see)."""
    quote = None
    for i, ch in enumerate(line[:at]):
        if quote:
            if ch == quote and line[i - 1] != "\\":
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return False
    return quote is None


def candidates(body: str):
    """(what changed, mutated body) for each one-line change of ``body`` (written at column 0)."""
    lines = body.splitlines()
    for i, line in enumerate(lines):
        code = line.strip()
        if not code or code.startswith("#"):
            continue
        indent = line[:len(line) - len(line.lstrip())]
        changes = []
        if not code.endswith(":"):  # a block opener deleted would leave its body hanging
            changes.append((f"{indent}pass", "deleted"))
        for old, new in SWAPS:
            at = next((m.start() for m in re.finditer(re.escape(old), line) if _in_code(line, m.start())), None)
            if at is not None:
                changes.append((line[:at] + new + line[at + len(old):], f"{old.strip()} -> {new.strip() or 'nothing'}"))
        m = next((m for m in _NUMBER.finditer(line) if _in_code(line, m.start())), None)
        if m:
            n = int(m.group(1))
            changes.append((line[:m.start()] + str(n + 1) + line[m.end():], f"{n} -> {n + 1}"))
        for new_line, what in changes:
            if new_line != line:
                yield what, "\n".join(lines[:i] + [new_line] + lines[i + 1:]) + "\n"
