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
"""
from __future__ import annotations


def is_unwritten(exc: BaseException, exercise_id: str) -> bool:
    """True when ``exc`` is the student edition's stub of ``exercise_id`` (not yet written)."""
    return isinstance(exc, NotImplementedError) and str(exc).startswith(f"{exercise_id}:")
