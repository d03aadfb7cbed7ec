"""Pausing generation so weights can change between two steps, and what each pause cost.

``Pausing`` is the part of ``Engine`` that stops and resumes serving: the pause modes
(abort / wait / keep / retract, with their SGLang and vLLM names), the cache flush, the
refusal of an update while requests run unpaused, and ``wait`` mode's drain. It owns the
pause state (``paused``, ``pause_mode``) and the cost ledger ``pause_stats``: one record
per pause, filled in as things happen (measured, never predicted).
"""
from __future__ import annotations

import time

import torch

from course_lib.engine.history import PAUSE_STATS_SIZE, History
from course_lib.layers.quant import pending_layers
from course_lib.weights.update import UpdateError

# Pause modes and their SGLang / vLLM names.
PAUSE_MODES = {"abort": "abort", "wait": "wait", "keep": "keep", "in_place": "keep", "retract": "retract"}


class EnginePausedError(RuntimeError):
    """New work refused while generation is paused for an update; retry after continue."""
    retryable = True


class EngineBusyError(RuntimeError):
    """An update while requests are in flight and generation is not paused."""
    retryable = False


def new_pause_record(mode: str) -> dict:
    """What one pause cost, filled in as it happens (measured, not predicted)."""
    return {"mode": mode, "aborted_requests": 0, "discarded_tokens": 0, "retracted_requests": 0,
            "reprefill_tokens": 0, "wait_s": 0.0, "mixed_requests": 0, "kv_fresh": True,
            "updates": 0, "resume_ms": 0.0}


class Pausing:
    """Pause, continue, flush and drain (mixed into ``Engine``)."""

    def _init_pause_state(self) -> None:
        self.paused = False
        self.pause_mode: str | None = None
        # One record per pause, what it cost (see pause_generation): the newest PAUSE_STATS_SIZE.
        self.pause_stats = History(PAUSE_STATS_SIZE)

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
        record = new_pause_record(mode)
        self.pause_stats.append(record)
        aborted = self._handle_in_flight(mode, record, "aborted by pause_generation")
        self.paused, self.pause_mode = True, mode
        return {"paused": True, "mode": mode, "num_aborted_requests": aborted}

    def _handle_in_flight(self, mode: str, record: dict, message: str) -> int:
        """What a pause in ``mode`` does, right now, to the requests in flight; returns
        how many it aborted. ``mode`` is a canonical name (``PAUSE_MODES``' values);
        ``record`` is this pause's cost record (``new_pause_record``); ``message`` goes
        into an aborted request's finish reason.

        - ``abort``: every running request, then every queued one, finishes now:
          ``self.scheduler.finish(seq, {"type": "abort", "message": message})`` (which
          frees its KV), and its output ``self._output(seq)`` is appended to
          ``self._pending`` so that the next ``step()`` returns it. Its generated tokens
          are thrown away: add ``seq.num_completion_tokens`` to
          ``record["discarded_tokens"]``, and 1 to ``record["aborted_requests"]`` per
          request. Returns the number of requests aborted.
        - ``retract``: every running request goes back to the queue with its KV freed
          (``self.scheduler.preempt(seq, out_of_memory=False)``), so that the queue then
          starts with the retracted requests in their running order, ahead of those
          already queued (which are left alone). Each remembers the pause
          (``seq.retract_record = record``: the step that prefills it again adds the
          tokens it computes to ``record["reprefill_tokens"]``) and counts 1 in
          ``record["retracted_requests"]``. Returns 0.
        - ``keep`` and ``wait``: nothing happens now (the requests stay where they are,
          KV and all); returns 0.

        Any other mode raises ``ValueError`` and changes nothing.
        """
        # BEGIN EXERCISE ch02.pause_modes
        if mode == "abort":
            seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
            for seq in seqs:
                record["discarded_tokens"] += seq.num_completion_tokens
                self.scheduler.finish(seq, {"type": "abort", "message": message})
                self._pending.append(self._output(seq))
            record["aborted_requests"] += len(seqs)
            return len(seqs)
        if mode == "retract":
            # preempt puts a request first in line: going from the last running request
            # to the first leaves them in their running order at the queue's head.
            for seq in reversed(list(self.scheduler.running)):
                self.scheduler.preempt(seq, out_of_memory=False)
                seq.retract_record = record
                record["retracted_requests"] += 1
            return 0
        if mode in ("keep", "wait"):
            return 0
        raise ValueError(f"unknown pause mode {mode!r}; expected abort, wait, keep or retract")
        # END EXERCISE

    def _abort_all(self, message: str, record: dict) -> int:
        """Abort every running and queued request now (``abort`` mode's part, also used
        by an update made with ``abort_all_requests=True``); returns how many."""
        return self._handle_in_flight("abort", record, message)

    def continue_generation(self) -> dict:
        """Resume: frozen and retracted requests go on with the current weights. Refused
        while a chunked update left a quantized fused layer waiting for shards."""
        waiting = pending_layers(self.model)
        if waiting:
            raise UpdateError(f"cannot resume: {len(waiting)} layers still wait for shards of an update, "
                              f"e.g. {next(iter(waiting.items()))}; send them first")
        t0 = time.perf_counter()
        if self.paused:
            self.verify_addresses()  # the full audit, once per pause, before serving again
            self.paused, self.pause_mode = False, None
            if self.config.is_cuda:
                self._release_transfer_buffers()
                torch.cuda.empty_cache()  # return the update's temporaries (as SGLang does)
            self.pause_stats[-1]["resume_ms"] = 1e3 * (time.perf_counter() - t0)
        return {"paused": False}

    def flush_cache(self) -> bool:
        """Forget every prefix-cache entry; True when flushed, False when refused.

        Refused (returns False, nothing changed) while requests are being served: some
        request is running or queued (``self.scheduler.running`` / ``.waiting``) and
        generation is either not paused (``self.paused``) or paused in ``wait`` mode
        (``self.pause_mode == "wait"``: those requests still run). Otherwise, idle or
        paused in ``abort``, ``keep`` or ``retract`` mode, it flushes: it sets
        ``self.last_flush_entries`` to the number of entries ``self.block_manager.flush()``
        dropped and returns True. Flushing while paused is safe: queued requests hold no
        cache entries, and dropping entries never touches the KV of a frozen request (the
        deadlock of SGLang #22620 cannot happen here).
        """
        # BEGIN EXERCISE ch02.flush_rules
        serving = bool(self.scheduler.running or self.scheduler.waiting)
        if serving and (not self.paused or self.pause_mode == "wait"):
            return False
        self.last_flush_entries = self.block_manager.flush()
        return True
        # END EXERCISE

    def live_kv_is_fresh(self) -> bool:
        """True when every live KV block was computed by the current weights."""
        return all(seq.kv_epoch == self.weight_update_count
                   for seq in self.scheduler.running if seq.block_table)

    def _refuse_if_busy(self, abort_all_requests: bool) -> None:
        """Raise ``EngineBusyError`` when requests are in flight, generation is not
        paused, and the update was not asked to abort them."""
        in_flight = len(self.scheduler.running) + len(self.scheduler.waiting)
        if in_flight and not self.paused and not abort_all_requests:
            raise EngineBusyError(f"{in_flight} requests in flight and generation is not paused: "
                                  f"call pause_generation(mode) first, or pass abort_all_requests=True")

    def _pause_record_for_update(self) -> dict:
        """The record an update's costs go to: the current pause's, or a new one for an
        update made without a pause (mode "abort" when it aborts requests, else "none")."""
        if self.paused:
            return self.pause_stats[-1]
        in_flight = bool(self.scheduler.running or self.scheduler.waiting)
        record = new_pause_record("abort" if in_flight else "none")
        self.pause_stats.append(record)
        return record

    def _drain(self, timeout_s: float, record: dict) -> None:
        """``wait`` mode, before an update: run the in-flight requests to completion on the
        old weights. ``timeout_s`` is how long the drain may take in seconds; ``record`` is
        this pause's cost record (``new_pause_record``).

        While some request is running or queued (``self.scheduler.running`` /
        ``.waiting``), run one engine step (``self.step()``, which works while paused in
        ``wait`` mode). Before each step, if more than ``timeout_s`` seconds have passed
        since the drain began (``time.perf_counter()``), raise ``TimeoutError`` with a
        message that says the weights were not changed; the update then stops before it
        writes anything, and the requests still in flight stay where they are.

        ``self.step()`` returns the outputs of the requests that finished in it (and
        clears ``self._pending``, the outputs waiting for the next step): append every
        one of them to ``self._pending``, so that the caller's next ``step()`` returns
        each exactly once. Either way, done or timed out, add the seconds the drain took
        to ``record["wait_s"]``. Nothing in flight: returns at once (adding ~0 s).
        """
        # BEGIN EXERCISE ch02.wait_drain
        t0 = time.perf_counter()
        try:
            while self.scheduler.running or self.scheduler.waiting:
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"in-flight requests did not finish within {timeout_s} s; "
                                       f"the weights were not changed")
                finished = self.step()  # returns (and clears) what was pending, plus new outputs
                self._pending += finished
        finally:
            record["wait_s"] += time.perf_counter() - t0
        # END EXERCISE
