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
        aborted = 0
        if mode == "abort":
            aborted = self._abort_all("aborted by pause_generation", record)
        elif mode == "retract":
            self._retract_running(record)
        self.paused, self.pause_mode = True, mode
        return {"paused": True, "mode": mode, "num_aborted_requests": aborted}

    def _abort_all(self, message: str, record: dict) -> int:
        """``abort``: finish every running and queued request now; their outputs (finish
        reason abort) come out of the next ``step()``. Counts the discarded tokens."""
        seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in seqs:
            record["discarded_tokens"] += seq.num_completion_tokens
            self.scheduler.finish(seq, {"type": "abort", "message": message})
            self._pending.append(self._output(seq))
        record["aborted_requests"] += len(seqs)
        return len(seqs)

    def _retract_running(self, record: dict) -> None:
        """``retract``: every running request goes back to the queue's head with its KV
        freed; its re-prefill is counted when it runs (``Engine.step``)."""
        for seq in reversed(list(self.scheduler.running)):  # reversed: keeps their order at the queue's head
            self.scheduler.preempt(seq, out_of_memory=False)
            seq.retract_record = record
            record["retracted_requests"] += 1

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
        """Forget every prefix-cache entry. Refused (False, nothing changed) while requests
        are being served. While paused in abort, keep or retract mode it is allowed: the
        queued requests hold no cache entries, and dropping entries never touches the KV
        of a frozen request (the deadlock of SGLang #22620 cannot happen here)."""
        serving = bool(self.scheduler.running or self.scheduler.waiting)
        if serving and (not self.paused or self.pause_mode == "wait"):
            return False
        self.last_flush_entries = self.block_manager.flush()
        return True

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
        """``wait`` mode: run the in-flight requests to completion before the update."""
        t0 = time.perf_counter()
        while self.scheduler.running or self.scheduler.waiting:
            if time.perf_counter() - t0 > timeout_s:
                record["wait_s"] += time.perf_counter() - t0
                raise TimeoutError(f"in-flight requests did not finish within {timeout_s} s; "
                                   f"the weights were not changed")
            finished = self.step()  # returns (and clears) what was pending, plus new outputs
            self._pending += finished
        record["wait_s"] += time.perf_counter() - t0
