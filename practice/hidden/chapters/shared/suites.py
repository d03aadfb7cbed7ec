"""Grading a test-writing part: the learner's tests, run on the reference and on buggy variants.

A test-writing part (``chNN.<name>_tests``, ``"scoring": "share"`` in chapter.json) is a
function in ``course_lib`` that receives a component and raises when the component breaks
its contract (returns quietly when it keeps it). Its hidden cases:

- one gate: the learner's tests pass on the reference component (a test that fails a right
  component is a wrong test; without this gate, a suite that always fails would catch
  everything);
- one ``..._catches_...`` case per buggy variant: the learner's tests must fail on it. The
  share of these that pass is the share of the part's points (chapter_run.share_earned).

The reference and the variants are region bodies: the reference's is read from the reference
edition (``$COURSE_REFERENCE_ROOT``, the instructor's tree, which the learner's code cannot
reach; the ``reference_root`` fixture), each variant's is written in the hidden tests. ``as_function`` compiles a body into a
function with the same parameters and module globals as the region's function in the
learner's edition (the code outside regions is the same in both editions), so the variant
runs exactly where the learner's own part would.
"""
from __future__ import annotations

import inspect
import textwrap
from pathlib import Path


def reference_body(root: str, relative_path: str, exercise_id: str) -> str:
    """The reference's body of region ``exercise_id`` in ``course_lib/<relative_path>`` of
    the reference edition at ``root`` (the judge's ``reference_root`` fixture), at column 0."""
    lines = (Path(root) / "course_lib" / relative_path).read_text(encoding="utf-8").splitlines()
    begin = next(i for i, line in enumerate(lines) if line.strip() == f"# BEGIN EXERCISE {exercise_id}")
    end = next(i for i in range(begin, len(lines)) if lines[i].strip() == "# END EXERCISE")
    return textwrap.dedent("\n".join(lines[begin + 1:end])) + "\n"


def as_function(function, body: str):
    """A function with ``function``'s name, parameters (defaults included) and module globals,
    whose body is ``body`` (at column 0)."""
    sig = inspect.signature(function)
    names, defaults, seen_star = [], {}, False
    for p in sig.parameters.values():
        name = p.name
        if p.default is not p.empty:
            defaults[f"_default_{name}"] = p.default
            name += f"=_default_{p.name}"
        if p.kind is p.VAR_POSITIONAL:
            name, seen_star = "*" + p.name, True
        elif p.kind is p.VAR_KEYWORD:
            name = "**" + p.name
        elif p.kind is p.KEYWORD_ONLY and not seen_star:
            names.append("*")
            seen_star = True
        names.append(name)
    source = f"def {function.__name__}({', '.join(names)}):\n{textwrap.indent(body, '    ')}"
    namespace = {**function.__globals__, **defaults}
    exec(compile(source, f"<{function.__qualname__} variant>", "exec"), namespace)  # noqa: S102 - the judge's own text
    return namespace[function.__name__]


def run_tests(tests, *component) -> str | None:
    """Run the learner's ``tests(*component)``: None when they pass (return quietly), else
    what they raised, in words (``course_lib.testing.verdict``: a stub, the part not written
    yet, is raised again and never counts as catching a variant)."""
    from course_lib.testing import verdict

    exc = verdict(tests, *component)
    if exc is None:
        return None
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) < 300 else text[:297] + "..."
