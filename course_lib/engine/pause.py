"""Pausing generation so weights can change between two steps, and what each pause cost.

``PauseControl`` stops and resumes serving: the pause modes (abort / wait / keep /
retract, with their SGLang and vLLM names), the cache flush, the refusal of an update
while requests run unpaused, and ``wait`` mode's drain. It owns the pause state
(``paused``, ``pause_mode``) and the cost ledger ``stats``: one ``PauseRecord`` per pause,
filled in as things happen (measured, never predicted).

It is built with what it acts on and nothing more: the scheduler (the queues), the block
manager (the prefix cache), the engine's ``outbox`` (outputs finished outside a step,
which the next ``step()`` returns), ``finish_request`` (end a request now, returning its
output) and ``step`` (one engine step, for ``wait`` mode's drain). The update side
(``updater.py``) asks it for the pause record, the drain and the busy refusal; it never
asks the update side anything.
"""
from __future__ import annotations

import time
from typing import Callable

from course_lib.engine.block_manager import BlockManager
from course_lib.history import PAUSE_STATS_SIZE, History
from course_lib.engine.records import PauseRecord
from course_lib.engine.scheduler import Scheduler
from course_lib.engine.sequence import Sequence

# Pause modes and their SGLang / vLLM names.
PAUSE_MODES = {"abort": "abort", "wait": "wait", "keep": "keep", "in_place": "keep", "retract": "retract"}


class EnginePausedError(RuntimeError):
    """New work refused while generation is paused for an update; retry after continue."""
    retryable = True


class EngineBusyError(RuntimeError):
    """An update while requests are in flight and generation is not paused."""
    retryable = False


class PauseControl:
    """Pause, resume, flush and drain; the pause state and its cost ledger."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, outbox: list[dict],
                 finish_request: Callable[[Sequence, dict], dict], step: Callable[[], list[dict]]):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.outbox = outbox                  # outputs the next step() returns (shared with the engine)
        self.finish_request = finish_request  # end a request now (KV freed); returns its output
        self.step = step                      # one engine step (runs while paused in wait mode)
        self.paused = False
        self.pause_mode: str | None = None
        self.last_flush_entries = 0
        # One record per pause, what it cost (see pause_generation): the newest PAUSE_STATS_SIZE.
        self.stats: History = History(PAUSE_STATS_SIZE)

    def pause_generation(self, mode: str = "abort") -> dict:
        """Stop generating so weights can change between two steps. In-flight requests:

        - ``abort``: finish now with ``finish_reason {"type": "abort"}``; their tokens are discarded;
        - ``wait``: keep running until done; an update waits for them (new requests are refused);
        - ``keep`` (``in_place``): frozen; after the update they continue on the new weights
          with the KV the old weights computed;
        - ``retract``: back to the queue with their KV freed; re-prefilled (prompt plus
          generated tokens) on the new weights after ``continue_generation``.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected one of {sorted(PAUSE_MODES)}")
        mode = PAUSE_MODES[mode]
        if self.paused:
            if mode != self.pause_mode:
                raise ValueError(f"already paused in {self.pause_mode!r} mode; continue_generation() first")
            return {"paused": True, "mode": mode, "num_aborted_requests": 0}
        record = PauseRecord(mode)
        self.stats.append(record)
        aborted = self.handle_in_flight(mode, record, "aborted by pause_generation")
        self.paused, self.pause_mode = True, mode
        return {"paused": True, "mode": mode, "num_aborted_requests": aborted}

    def handle_in_flight(self, mode: str, record: PauseRecord, message: str) -> int:
        """What a pause in ``mode`` does, right now, to the requests in flight; returns
        how many it aborted. ``mode`` is a canonical name (``PAUSE_MODES``' values),
        ``record`` this pause's ``PauseRecord``, ``message`` the text an aborted request's
        finish reason carries.

        - ``abort``: every request in flight, running or queued, ends now: its finish
          reason is ``{"type": "abort", "message": message}``, its KV blocks are free
          again, and its output comes out of the engine's next ``step()``, exactly once
          (running requests' outputs first, then queued ones', each in queue order). Its
          generated tokens count in ``record.discarded_tokens``; each aborted request
          counts in ``record.aborted_requests``. Returns how many were aborted.
        - ``retract``: every running request is back in the queue with its KV freed, ahead
          of the requests already queued (untouched), in its running order. Each counts
          in ``record.retracted_requests``, and carries the record until the step that
          prefills it again (``seq.retract_record``), which charges the tokens it
          recomputes to ``record.reprefill_tokens``. Returns 0.
        - ``keep`` and ``wait``: nothing changes now; returns 0.

        Any other mode raises ``ValueError`` and changes nothing.
        """
        # BEGIN EXERCISE ch02.pause_modes
        if mode == "abort":
            seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
            for seq in seqs:
                record.discarded_tokens += seq.num_completion_tokens
                self.outbox.append(self.finish_request(seq, {"type": "abort", "message": message}))
            record.aborted_requests += len(seqs)
            return len(seqs)
        if mode == "retract":
            # preempt puts a request first in line: going from the last running request
            # to the first leaves them in their running order at the queue's head.
            for seq in reversed(list(self.scheduler.running)):
                self.scheduler.preempt(seq, out_of_memory=False)
                seq.retract_record = record
                record.retracted_requests += 1
            return 0
        if mode in ("keep", "wait"):
            return 0
        raise ValueError(f"unknown pause mode {mode!r}; expected abort, wait, keep or retract")
        # END EXERCISE

    def abort_all(self, message: str, record: PauseRecord) -> int:
        """Abort every running and queued request now (``abort`` mode's part, also used
        by an update made with ``abort_all_requests=True``); returns how many."""
        return self.handle_in_flight("abort", record, message)

    def resume(self) -> PauseRecord | None:
        """Leave the pause (the caller checked the weights first); returns the pause's
        record, or None when generation was not paused."""
        if not self.paused:
            return None
        self.paused, self.pause_mode = False, None
        return self.stats[-1]

    def flush_cache(self) -> bool:
        """Forget every prefix-cache entry; True when flushed, False when refused.

        Refused (returns False, nothing changed) while requests are being served: some
        request is running or queued, and generation is either not paused or paused in
        ``wait`` mode (those requests still run). Otherwise (idle, or paused in ``abort``,
        ``keep`` or ``retract`` mode) every entry is gone, ``self.last_flush_entries``
        says how many were dropped, and it returns True. Flushing while paused is safe:
        queued requests hold no cache entries, and dropping entries never touches the KV
        of a frozen request (the deadlock of SGLang #22620 cannot happen here).
        """
        # BEGIN EXERCISE ch02.flush_rules
        serving = bool(self.scheduler.running or self.scheduler.waiting)
        if serving and (not self.paused or self.pause_mode == "wait"):
            return False
        self.last_flush_entries = self.block_manager.flush()
        return True
        # END EXERCISE

    def live_kv_is_fresh(self, weight_update_count: int) -> bool:
        """True when every live KV block was computed by the current weights (the
        ``weight_update_count``-th update's)."""
        return all(seq.kv_epoch == weight_update_count for seq in self.scheduler.running if seq.block_table)

    def in_flight(self) -> int:
        """Requests running or queued."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def refuse_if_busy(self, abort_all_requests: bool) -> None:
        """Raise ``EngineBusyError`` when requests are in flight, generation is not
        paused, and the update was not asked to abort them."""
        in_flight = self.in_flight()
        if in_flight and not self.paused and not abort_all_requests:
            raise EngineBusyError(f"{in_flight} requests in flight and generation is not paused: "
                                  f"call pause_generation(mode) first, or pass abort_all_requests=True")

    def record_for_update(self) -> PauseRecord:
        """The record an update's costs go to: the current pause's, or a new one for an
        update made without a pause (mode "abort" when it aborts requests, else "none")."""
        if self.paused:
            return self.stats[-1]
        record = PauseRecord("abort" if self.in_flight() else "none")
        self.stats.append(record)
        return record

    def drain(self, timeout_s: float, record: PauseRecord) -> None:
        """``wait`` mode, before an update: the requests in flight run to completion on
        the old weights, then this returns. ``timeout_s``: how long the drain may take,
        in seconds; ``record``: this pause's ``PauseRecord``.

        Promises:
        - on return nothing is running or queued, and the output of every request that
          finished meanwhile comes out of the engine's next ``step()``, each exactly once;
        - once the drain has taken longer than ``timeout_s``, it stops before starting
          another step and raises ``TimeoutError`` saying the weights were not changed
          (the update stops before it writes anything; the requests still in flight stay
          where they are);
        - done or timed out, the seconds it took are added to ``record.wait_s``;
        - nothing in flight: returns at once (adding about 0 s).
        """
        # BEGIN EXERCISE ch02.wait_drain
        t0 = time.perf_counter()
        try:
            while self.scheduler.running or self.scheduler.waiting:
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"in-flight requests did not finish within {timeout_s} s; "
                                       f"the weights were not changed")
                finished = self.step()  # returns (and clears) the outbox, plus new outputs
                self.outbox += finished
        finally:
            record.wait_s += time.perf_counter() - t0
        # END EXERCISE
