"""Which edition of the course this tree is: the one marker the engine's fast paths read.

In the instructor edition every exercise region holds the reference answer. The student
edition (``scripts/release.py``) writes ``EDITION = "student"`` here: every region there
is a learner's (or its stub). A maintainer's copy of the instructor edition with some
regions' bodies swapped for other code (``judge.py check``, mutation runs) lists those
regions in ``REPLACED``. ``exercises.is_reference`` reads both; nothing else does.
"""
EDITION = "instructor"
REPLACED: frozenset[str] = frozenset()
