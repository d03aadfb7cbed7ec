"""Bounded logs: the engine's per-step and per-update records kept in ring buffers.

A serving engine runs for days; a record kept per step or per update for ever grows
without bound (hundreds of bytes a step add up to gigabytes). ``History`` keeps only the
newest ``maxlen`` records and counts every one ever added (``total``), so a reader can
still ask for "everything since I last looked" (``since``) while the oldest records fall
off. It indexes and slices like a list (``log[-1]``, ``log[-5:]``).

Sizes, chosen so that each log stays around a megabyte or two at most:

- ``STEP_LOG_SIZE`` steps of ``Engine.step_log`` (about 150 bytes each plus the request ids);
- ``UPDATE_HISTORY_SIZE`` results of ``Engine.update_history`` (about 2 KB each);
- ``PAUSE_STATS_SIZE`` pause records of ``Engine.pause_stats`` (about 1 KB each).
"""
from __future__ import annotations

import collections

STEP_LOG_SIZE = 4096
UPDATE_HISTORY_SIZE = 1024
PAUSE_STATS_SIZE = 1024


class History(collections.deque):
    """A deque with a fixed ``maxlen`` that slices like a list and counts what it dropped."""

    def __init__(self, maxlen: int):
        if not isinstance(maxlen, int) or maxlen <= 0:
            raise ValueError(f"maxlen must be a positive integer, got {maxlen!r}")
        super().__init__((), maxlen)
        self.total = 0  # records ever appended, kept or dropped

    def append(self, item) -> None:
        super().append(item)
        self.total += 1

    def extend(self, items) -> None:
        for item in items:
            self.append(item)

    def __getitem__(self, index):
        if isinstance(index, slice):  # a copy, as a list's slice is (at most maxlen records)
            return list(self)[index]
        return super().__getitem__(index)

    def __copy__(self) -> "History":
        return _rebuild(self.maxlen, list(self), self.total)

    def __reduce_ex__(self, protocol):  # copy.deepcopy and pickle: same maxlen, records and total
        return _rebuild, (self.maxlen, list(self), self.total)

    def since(self, total: int) -> list:
        """The records appended after ``self.total`` was ``total`` (those still kept)."""
        new = self.total - total
        if new <= 0:
            return []
        return self[-min(new, len(self)):]


def _rebuild(maxlen: int, items: list, total: int) -> History:
    history = History(maxlen)
    history.extend(items)
    history.total = total
    return history
