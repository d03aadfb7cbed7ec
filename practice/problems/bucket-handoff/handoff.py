"""The test bench of bucket-handoff: a real engine in another process, fed by your sender.

``EngineProcess`` starts an engine in a child process (spawned, as a co-located engine
is). Your ``send_weights`` gets its ``post`` and ``wait_ack``: ``post`` puts one
serialized bucket on the engine's queue and returns a receipt at once; ``wait_ack(receipt)``
blocks until the engine has applied that bucket and acknowledged it. The engine takes
buckets in order, and when it opens one is set by a handshake, never by a clock:

- ``"lazy"`` (the default): a bucket is opened only when the sender waits for it (or
  for a later one), the latest moment a real engine may read it. A buffer written again
  before its bucket was acknowledged is therefore always caught, on any machine.
- ``"eager"``: a bucket is opened the moment it arrives, the earliest moment. On a GPU
  this catches bytes that are not in the buffer yet (copies still queued on a stream).

The rules are counted where your code cannot change them: in the engine's process, which
records how many buckets were in flight (received, not yet applied) at each arrival and
when ``send_weights`` returned, and reports that at the end. ``compare(path)`` asks the
engine which of its tensors differ from a cold start on ``path``.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass, field

CTX = mp.get_context("spawn")  # a forked child would inherit torch's threads in a bad state
MODES = ("lazy", "eager")


def serve(checkpoint, device, mode, inbox, outbox) -> None:
    """The engine's side (runs in the child): apply buckets in order, acknowledge each, count."""
    import torch

    from course_lib import Engine

    engine = Engine(checkpoint, device=device)
    pending: list = []  # (receipt, payload) received, not yet applied
    log = {"received": 0, "in_flight_at_post": [], "unacked_at_return": []}

    def apply_through(last: int) -> None:
        while pending and pending[0][0] <= last:
            receipt, payload = pending.pop(0)
            try:
                engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=False)
                outbox.put(("ack", receipt))
            except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
                outbox.put(("error", f"bucket {receipt}: {type(exc).__name__}: {exc}"))

    outbox.put(("ready", None))
    while True:
        kind, *args = inbox.get()
        if kind == "bucket":
            pending.append(tuple(args))
            log["received"] += 1
            log["in_flight_at_post"].append(len(pending))
            if mode == "eager":
                apply_through(args[0])
        elif kind == "apply_through":  # the sender waits for this bucket: now it must be read
            apply_through(args[0])
        elif kind == "returned":
            log["unacked_at_return"] = [r for r, _ in pending]
        elif kind == "report":
            outbox.put(("report", dict(log)))
            log = {"received": 0, "in_flight_at_post": [], "unacked_at_return": []}
        elif kind == "compare":
            cold = Engine(args[0], device=device).model.state_dict()
            hot = engine.model.state_dict()
            outbox.put(("compared", [k for k, v in hot.items() if not torch.equal(v, cold[k])]))
        else:
            return


@dataclass
class Stats:
    """The test side's own bookkeeping (receipts and acknowledgements), for ``wait_ack``.
    The sender can reach it; the graded counts come from the engine's process instead."""
    posted: int = 0
    acked: set = field(default_factory=set)
    in_flight_at_post: list = field(default_factory=list)


class EngineProcess:
    def __init__(self, checkpoint, device: str = "cpu", mode: str = "lazy", timeout_s: float = 60.0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.inbox, self.outbox = CTX.Queue(), CTX.Queue()
        self.mode, self.timeout_s = mode, timeout_s
        self.process = CTX.Process(target=serve, args=(str(checkpoint), device, mode, self.inbox, self.outbox),
                                   daemon=True)
        self.process.start()
        self._expect("ready")
        self.stats = Stats()

    # -- what send_weights gets ------------------------------------------------------
    def post(self, payload) -> int:
        """Send one serialized bucket; returns its receipt at once."""
        if not isinstance(payload, (str, bytes)):
            raise TypeError(f"post takes a serialized bucket (str or bytes), got {type(payload).__name__}")
        self._drain()
        receipt = self.stats.posted
        self.stats.posted += 1
        self.inbox.put(("bucket", receipt, payload))
        self.stats.in_flight_at_post.append(self.stats.posted - len(self.stats.acked))
        return receipt

    def wait_ack(self, receipt: int) -> None:
        """Block until bucket ``receipt`` has been applied by the engine."""
        if not isinstance(receipt, int) or not 0 <= receipt < self.stats.posted:
            raise ValueError(f"no bucket with receipt {receipt!r} was posted")
        if receipt in self.stats.acked:
            return
        if self.mode == "lazy":
            self.inbox.put(("apply_through", receipt))
        deadline = time.monotonic() + self.timeout_s
        while receipt not in self.stats.acked:
            self._take(max(0.0, deadline - time.monotonic()))

    # -- what the tests use ----------------------------------------------------------------
    def run(self, send_weights, named_tensors, busy_cycles: int = 0, **options) -> dict:
        """Call ``send_weights`` with this engine; then let the engine finish and report its counts.

        ``busy_cycles`` (a GPU case): after every acknowledgement the sender's current CUDA
        stream gets that many cycles of work first, so whatever the sender queues next
        (packing the next bucket into the freed buffer) is still queued when it returns."""
        self.stats = Stats()
        wait_ack = self.wait_ack
        if busy_cycles:
            import torch

            def wait_ack(receipt: int) -> None:
                self.wait_ack(receipt)
                torch.cuda._sleep(busy_cycles)  # the stream is busy, as a trainer's often is
        returned = send_weights(named_tensors, self.post, wait_ack, **options)
        self.inbox.put(("returned",))
        self.inbox.put(("apply_through", float("inf")))  # let the engine finish before comparing
        self.inbox.put(("report",))
        counted = self._expect("report")
        in_flight = counted["in_flight_at_post"]
        return {"returned": returned, "posted": counted["received"], "max_in_flight": max(in_flight, default=0),
                "in_flight_at_post": in_flight, "unacked_at_return": counted["unacked_at_return"]}

    def compare(self, checkpoint) -> list[str]:
        """Names of the engine's tensors that differ from a cold start on ``checkpoint``."""
        self.inbox.put(("compare", str(checkpoint)))
        return self._expect("compared")

    def close(self) -> None:
        self.inbox.put(("stop",))
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()

    # -- plumbing ----------------------------------------------------------------------
    def _take(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.outbox.get(timeout=0.2)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"the engine process ended (exit code {self.process.exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the engine sent nothing for {timeout:g} s") from None
        return self._note(*message)

    def _drain(self) -> None:
        """Take every message already there, without waiting."""
        while True:
            try:
                message = self.outbox.get_nowait()
            except queue.Empty:
                return
            self._note(*message)

    def _note(self, kind, value):
        if kind == "error":
            raise RuntimeError(f"the engine could not apply a bucket: {value}")
        if kind == "ack":
            self.stats.acked.add(value)
        return kind, value

    def _expect(self, wanted):
        while True:
            kind, value = self._take(self.timeout_s)
            if kind == wanted:
                return value
