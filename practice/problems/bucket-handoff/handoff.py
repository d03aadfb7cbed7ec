"""The test bench of bucket-handoff: a real engine in another process, fed by your sender.

``EngineProcess`` starts an engine in a child process (spawned, as a co-located engine
is). Your ``send_weights`` gets its ``post`` and ``wait_ack``: ``post`` puts one
serialized bucket on the engine's queue and returns a receipt at once; the engine takes
the buckets in order and, like a busy engine finishing its current step, waits
``delay_s`` before it opens each one and copies it into its weights, then acknowledges.
``wait_ack(receipt)`` blocks until that bucket was acknowledged.

The bench also watches the rules: how many buckets were in flight (posted, not yet
acknowledged) at each post, and whether any was still in flight when ``send_weights``
returned. ``compare(path)`` asks the engine which of its tensors differ from a cold
start on ``path``.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass, field

CTX = mp.get_context("spawn")  # a forked child would inherit torch's threads in a bad state


def serve(checkpoint, device, delay_s, inbox, outbox) -> None:
    """The engine's side (runs in the child): apply buckets in order, acknowledge each."""
    import torch

    from course_lib import Engine

    engine = Engine(checkpoint, device=device)
    outbox.put(("ready", None))
    while True:
        kind, *args = inbox.get()
        if kind == "bucket":
            receipt, payload = args
            time.sleep(delay_s)  # still busy with a step: the sender's memory must not change meanwhile
            try:
                engine.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=False)
                outbox.put(("ack", receipt))
            except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
                outbox.put(("error", f"bucket {receipt}: {type(exc).__name__}: {exc}"))
        elif kind == "compare":
            cold = Engine(args[0], device=device).model.state_dict()
            hot = engine.model.state_dict()
            outbox.put(("compared", [k for k, v in hot.items() if not torch.equal(v, cold[k])]))
        else:
            return


@dataclass
class Stats:
    posted: int = 0
    acked: set = field(default_factory=set)
    in_flight_at_post: list = field(default_factory=list)  # buckets in flight right after each post

    @property
    def max_in_flight(self) -> int:
        return max(self.in_flight_at_post, default=0)


class EngineProcess:
    def __init__(self, checkpoint, device: str = "cpu", delay_s: float = 0.04, timeout_s: float = 60.0):
        self.inbox, self.outbox = CTX.Queue(), CTX.Queue()
        self.timeout_s = timeout_s
        self.process = CTX.Process(target=serve, args=(str(checkpoint), device, delay_s, self.inbox, self.outbox),
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
        deadline = time.monotonic() + self.timeout_s
        while receipt not in self.stats.acked:
            self._take(max(0.0, deadline - time.monotonic()))

    # -- what the tests use ----------------------------------------------------------------
    def run(self, send_weights, named_tensors, **options) -> dict:
        """Call ``send_weights`` with this engine; then wait for every bucket and report."""
        self.stats = Stats()
        returned = send_weights(named_tensors, self.post, self.wait_ack, **options)
        self._drain()
        unacked_at_return = sorted(set(range(self.stats.posted)) - self.stats.acked)
        for receipt in range(self.stats.posted):  # let the engine finish before comparing
            self.wait_ack(receipt)
        return {"returned": returned, "posted": self.stats.posted, "max_in_flight": self.stats.max_in_flight,
                "in_flight_at_post": self.stats.in_flight_at_post, "unacked_at_return": unacked_at_return}

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
