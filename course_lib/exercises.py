"""Telling a learner's unwritten part from a real error.

In the student edition each exercise region's body is one ``raise NotImplementedError``
whose message starts with the exercise id (``"ch04.copy_in_place: write this part ..."``).
Most parts are on the path of the chapter that teaches them and later ones, so the
engine just stops there with that message. A few parts of a later chapter sit on the
path every earlier chapter uses (the commit step and the address audit of chapter 04 run
in every update, chapter 02's per-token tags in every step, chapter 03's layer-by-layer
buffer in every disk update); there the engine asks ``is_unwritten`` and takes the plain
path that needs no such part (switching the part off, never routing a written part
around), so a learner in chapter 02 is not sent to chapter 04 first.
``tests/test_release.py`` proves the order: each chapter's public and hidden cases pass
on a student edition with only that chapter's and the earlier chapters' parts written.

The other question, ``is_reference``: is this part the instructor edition's? A fast path
that does a learner's part's work its own way (``layers/direct_quant.py``, the copy tables
of ``weights/registered.py``) may run only where that part is the reference, so it can
never hide a wrong one.
"""
from __future__ import annotations

import hashlib
import inspect

_DIGESTS: dict[int, tuple[object, str | None]] = {}  # id(code) -> (code, digest): the code kept alive


def is_unwritten(exc: BaseException, exercise_id: str) -> bool:
    """True when ``exc`` is the student edition's stub of ``exercise_id`` (not yet written)."""
    return isinstance(exc, NotImplementedError) and str(exc).startswith(f"{exercise_id}:")


def fingerprint(func) -> str | None:
    """sha256 (hex) of ``func``'s source with every line stripped and blank lines dropped
    (so indentation and blank lines do not count; anything else, comments included,
    does); None when its source cannot be read. Cached per code object: a function
    redefined (``%autoreload``, a monkeypatch) has a new one."""
    code = getattr(getattr(func, "__func__", func), "__code__", None)
    if code is None:
        return None
    if id(code) not in _DIGESTS:
        try:
            lines = inspect.getsource(code).splitlines()
        except (OSError, TypeError):
            digest = None
        else:
            text = "\n".join(line.strip() for line in lines if line.strip())
            digest = hashlib.sha256(text.encode()).hexdigest()
        _DIGESTS[id(code)] = (code, digest)
    return _DIGESTS[id(code)][1]


def is_reference(func, digest: str) -> bool:
    """True when ``func`` is the instructor edition's: its ``fingerprint`` is ``digest``.

    Why: the engine's fast paths are built from the learner's parts, never around them.
    A fast path that does the work of some part its own way (instead of calling it) is
    only the same engine where that part is the reference. In the instructor edition
    every region holds the reference, the fingerprints recorded beside such a fast path
    match and it runs; in the student edition the region is the learner's code (or the
    stub), its fingerprint differs, and the engine takes the path that runs the
    learner's part, so a wrong part is what the tests see. A function replaced at run
    time (a test's or a notebook's) differs too. Only a hex digest is recorded, so the
    student edition's leak check finds no line of the reference in it."""
    return fingerprint(func) == digest
