"""What a serving process did, moment by moment, to explain a pause in serving.

A stream stops when the engine thread does not step, or steps slowly, or when the tokens
it made do not reach the client. ``StepTrace.attach(worker)`` records, on the clock the
load clients use (``time.monotonic``, one clock for every process of the machine):

- every pass of the engine thread: the step (prefill or decode, sequences, new tokens,
  CUDA graph or eager, the prefill's request ids), the commands that ran before it (how
  many, from when, how long in all, the slowest) and the hand-over of new tokens to the
  event loop after it, each timed;
- every Python garbage collection (``GcLog``: generation, objects freed, which thread);
- every Triton compile (``CompileLog``: which kernel, how long, which pointer arguments
  were not 16-byte aligned: Triton compiles a kernel again for each new alignment);
- how late the HTTP event loop runs a callback posted to it every few milliseconds
  (``LoopProbe``: a loop blocked by a slow handler, or starved of the GIL).

Nothing here runs unless attached: the worker's own methods are wrapped on that one
object (its class is untouched), so a server without a trace pays nothing. Attached,
each step costs two clock reads and one record. ``snapshot(start, end)`` returns what
fell in a window, as plain data (``bench/load_trace.py`` explains the gaps with it).
"""
from __future__ import annotations

import asyncio
import collections
import gc
import threading
import time

MAX_RECORDS = 200_000        # per log: about 20 minutes of steps at 150 a second
PROBE_EVERY_S = 0.005        # how often LoopProbe posts to the event loop
LATE_RECORD_S = 0.005        # a callback at least this late is recorded (all are counted)
GC_RECORD_S = 0.001          # a young collection this long is recorded; every full one is (all are counted)


class GcLog:
    """Python's collections in this process, while installed (``gc.callbacks``): every full
    collection, and the young ones that took ``GC_RECORD_S`` or more (hundreds a second
    take microseconds); ``counts`` counts them all, by generation."""

    def __init__(self, maxlen: int = MAX_RECORDS):
        self.records: collections.deque = collections.deque(maxlen=maxlen)
        self.counts = [0, 0, 0]
        self._start = 0.0  # a collection holds the GIL: one runs at a time

    def _callback(self, phase: str, info: dict) -> None:
        now = time.monotonic()
        if phase == "start":
            self._start = now
            return
        generation = info.get("generation", 0)
        self.counts[generation] += 1
        if generation == 2 or now - self._start >= GC_RECORD_S:
            self.records.append({"t0": self._start, "t1": now, "generation": generation,
                                 "collected": info.get("collected"), "thread": threading.current_thread().name})

    def install(self) -> "GcLog":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class CompileLog:
    """Triton's just-in-time compiles in this process, through its compile hooks
    (``triton.knobs.runtime``; ``available`` is False where Triton or its hooks are absent)."""

    def __init__(self, maxlen: int = MAX_RECORDS):
        self.records: collections.deque = collections.deque(maxlen=maxlen)
        self._started: dict = {}
        self._knobs = None
        self._before = (None, None)
        try:
            from triton import knobs
            self._knobs = knobs if hasattr(knobs.runtime, "jit_post_compile_hook") else None
        except Exception:  # noqa: BLE001 - no Triton (a CPU build of torch), or an older one
            pass
        self.available = self._knobs is not None

    def _pre(self, **kw):
        self._started[kw.get("key")] = time.monotonic()
        before = self._before[0]
        return before(**kw) if before is not None else None  # falsy: Triton goes on to compile

    def _post(self, **kw):
        now = time.monotonic()
        fn = kw.get("fn")
        self.records.append({"t0": self._started.pop(kw.get("key"), now), "t1": now,
                             "kernel": getattr(fn, "name", repr(fn)), "unaligned": _unaligned(kw),
                             "thread": threading.current_thread().name})
        after = self._before[1]
        return after(**kw) if after is not None else None

    def install(self) -> "CompileLog":
        if self.available:
            rt = self._knobs.runtime
            self._before = (rt.jit_cache_hook, rt.jit_post_compile_hook)
            rt.jit_cache_hook, rt.jit_post_compile_hook = self._pre, self._post
        return self

    def remove(self) -> None:
        if self.available and self._knobs.runtime.jit_post_compile_hook == self._post:
            self._knobs.runtime.jit_cache_hook, self._knobs.runtime.jit_post_compile_hook = self._before


def _unaligned(kw: dict) -> list[str] | None:
    """The pointer arguments Triton compiled this kernel for without its 16-byte alignment
    attribute, by name; None where the hook's arguments are not the ones known (3.4 to 3.6)."""
    try:
        compile_info = kw["compile"]
        signature = compile_info["signature"]
        attrs = compile_info["configs"][0]
        names = list(signature)
        aligned = {names[path[0]] for path in attrs}
        return [n for n, ty in signature.items() if str(ty).startswith("*") and n not in aligned]
    except Exception:  # noqa: BLE001 - instrumentation never fails a compile
        return None


class LoopProbe:
    """How late an event loop runs: a thread posts a callback every ``PROBE_EVERY_S`` and
    the callback notes how long it waited. Records the late ones (``LATE_RECORD_S``)."""

    def __init__(self, maxlen: int = MAX_RECORDS):
        self.records: collections.deque = collections.deque(maxlen=maxlen)
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _ran(self, posted: float) -> None:
        late = time.monotonic() - posted
        self.samples += 1
        if late >= LATE_RECORD_S:
            self.records.append({"t0": posted, "t1": posted + late})

    def _post(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.wait(PROBE_EVERY_S):
            try:
                loop.call_soon_threadsafe(self._ran, time.monotonic())
            except RuntimeError:  # the loop closed
                return

    def start(self, loop: asyncio.AbstractEventLoop) -> "LoopProbe":
        if self._thread is None:
            self._thread = threading.Thread(target=self._post, args=(loop,), name="loop-probe", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


class StepTrace:
    """The engine thread's passes, with the process's collections, compiles and event-loop
    lateness; see the module docstring. ``attach`` before the worker serves."""

    def __init__(self, maxlen: int = MAX_RECORDS):
        self.steps: collections.deque = collections.deque(maxlen=maxlen)
        self.gc, self.compiles, self.loop = GcLog(maxlen), CompileLog(maxlen), LoopProbe(maxlen)
        # Since the last step: count, seconds, the slowest's name and seconds, the first's start.
        self._commands = [0, 0.0, None, 0.0, 0.0]
        self._worker = None

    def attach(self, worker) -> "StepTrace":
        self._worker = worker
        step, run, push, submit = worker._step, worker._run, worker._push_progress, worker.submit

        def traced_step():
            e = worker.engine
            before = (e.step_log.total, e.num_prefill_tokens, len(e.scheduler.waiting), len(e.scheduler.running))
            t0 = time.monotonic()
            try:
                step()
            finally:
                self._record_step(e, t0, time.monotonic(), *before)

        def traced_run(fn, future):
            t0 = time.monotonic()
            try:
                run(fn, future)
            finally:
                took, c = time.monotonic() - t0, self._commands
                if c[0] == 0:
                    c[4] = t0
                c[0], c[1] = c[0] + 1, c[1] + took
                if took > c[3]:
                    c[2], c[3] = getattr(fn, "__qualname__", type(fn).__name__), took

        def traced_push():
            t0 = time.monotonic()
            try:
                push()
            finally:
                if self.steps:
                    self.steps[-1]["push_s"] = time.monotonic() - t0

        def traced_submit(fn):
            # The first command sent from the event loop's thread names the loop to probe.
            try:
                self.loop.start(asyncio.get_running_loop())
                worker.submit = submit  # found: back to the plain method
            except RuntimeError:
                pass
            return submit(fn)

        worker._step, worker._run, worker._push_progress, worker.submit = traced_step, traced_run, traced_push, \
            traced_submit
        self.gc.install()
        self.compiles.install()
        return self

    def detach(self) -> None:
        w = self._worker
        if w is not None:
            for name in ("_step", "_run", "_push_progress", "submit"):
                w.__dict__.pop(name, None)  # the class's own methods again
        self.gc.remove()
        self.compiles.remove()
        self.loop.stop()

    def _record_step(self, e, t0: float, t1: float, total: int, prefilled: int, waiting: int, running: int) -> None:
        cmds, cmd_s, slowest, slowest_s, cmd_t0 = self._commands
        self._commands = [0, 0.0, None, 0.0, 0.0]
        rec = {"t0": t0, "t1": t1, "kind": "none", "waiting": waiting, "running": running,
               "commands": cmds, "commands_s": cmd_s}
        if cmds:
            rec["commands_t0"] = cmd_t0  # they ran one after another from here, before the step
        if slowest_s >= 0.001:
            rec["slowest_command"], rec["slowest_command_s"] = slowest, slowest_s
        if e.step_log.total != total:
            last = e.step_log[-1]
            prefill, seqs = last["prefill"], len(last["rids"])
            tokens = e.num_prefill_tokens - prefilled if prefill else seqs
            rec.update(kind="prefill" if prefill else "decode", seqs=seqs, tokens=tokens,
                       graph=e.model_runner.replays_graph(prefill, tokens, seqs))
            if prefill:
                rec["rids"] = list(last["rids"])
        self.steps.append(rec)

    def snapshot(self, start: float = float("-inf"), end: float = float("inf")) -> dict:
        """Every record overlapping [start, end], as plain data (picklable, JSON-able)."""
        def within(records):
            return [dict(r) for r in list(records) if r["t1"] >= start and r["t0"] <= end]
        return {"steps": within(self.steps), "gc": within(self.gc.records), "gc_counts": list(self.gc.counts),
                "compiles": within(self.compiles.records), "loop_late": within(self.loop.records),
                "loop_samples": self.loop.samples, "compile_hooks": self.compiles.available}
