"""The course's hooks in one place: is a learner's part written, and is it the reference.

In the student edition each exercise region's body is one ``raise NotImplementedError``
whose message starts with the exercise id (``"ch04.copy_in_place: write this part ..."``).
Most parts are on the path of the chapter that teaches them and later ones, so the
engine just stops there with that message. A few parts of a later chapter sit on the
path every earlier chapter uses (the commit step and the address audit of chapter 04 run
in every update, chapter 02's per-token tags in every step, chapter 03's layer-by-layer
buffer in every disk update); there the engine asks ``is_written`` and takes the plain
path that needs no such part (switching the part off, never routing a written part
around), so a learner in chapter 02 is not sent to chapter 04 first.
``tests/test_release.py`` proves the order: each chapter's public and hidden cases pass
on a student edition with only that chapter's and the earlier chapters' parts written.

The other question, ``is_reference``: is this part the instructor edition's? A fast path
that does a learner's part's work its own way (``weights/commit/direct_quant.py``, the copy
tables of ``weights/commit/copy_table.py``) may run only where that part is the reference, so it
can never hide a wrong one. The answer comes from a stable marker, ``edition.py`` (which
edition this tree is, and which regions a maintainer's copy swapped), and from where the
function was defined (a function replaced at run time by a test or a notebook is not the
reference): editing a comment or a docstring never switches a fast path off.

Both answers are read from the function's own code, once per code object, so a function
redefined (``%autoreload``, a monkeypatch) is seen at once; asking costs a dict lookup.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

from course_lib import edition

_PACKAGE = Path(__file__).resolve().parent
_WRITTEN: dict[tuple[int, str], tuple[object, bool]] = {}  # (id(code), exercise) -> (code kept alive, answer)
_INSIDE: dict[int, tuple[object, bool]] = {}                # id(code) -> (code kept alive, answer)


def _code(func):
    return getattr(getattr(func, "__func__", func), "__code__", None)


def is_written(func, exercise_id: str) -> bool:
    """False while ``func`` still holds the student edition's stub of ``exercise_id`` (a
    ``raise NotImplementedError`` whose message starts with the id); True otherwise,
    including for a function whose source cannot be read."""
    code = _code(func)
    if code is None:
        return True
    key = (id(code), exercise_id)
    if key not in _WRITTEN:
        try:
            source = inspect.getsource(code)
        except (OSError, TypeError):
            source = ""
        stub = re.compile(r"raise\s+NotImplementedError\(\s*(['\"])" + re.escape(exercise_id) + ":")
        _WRITTEN[key] = (code, not stub.search(source))
    return _WRITTEN[key][1]


def _in_package(code) -> bool:
    """Whether ``code`` was compiled from this package's files (asked once per code object:
    resolving the path touches the file system, and the registered path asks per update)."""
    if id(code) not in _INSIDE:
        try:
            inside = Path(code.co_filename).resolve().is_relative_to(_PACKAGE)
        except (OSError, ValueError):
            inside = False
        _INSIDE[id(code)] = (code, inside)
    return _INSIDE[id(code)][1]


def is_reference(func, exercise_id: str | None = None) -> bool:
    """True when ``func`` is the instructor edition's code: defined in this package's own
    files (not replaced at run time) and, for the function holding exercise region
    ``exercise_id``, in the instructor edition with that region not swapped
    (``edition.py``). Functions that are no exercise are the reference wherever they
    were not replaced."""
    code = _code(func)
    if code is None or not _in_package(code):
        return False
    if exercise_id is None:
        return True
    return edition.EDITION == "instructor" and exercise_id not in edition.REPLACED
