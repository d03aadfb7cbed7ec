"""A stand-in trainer process that pushes a checkpoint's weights to an engine.

Real RL trainers hold their weights in GPU memory after an optimizer step; here a child
process reads them from a checkpoint instead, then hands them over exactly as a trainer
would: IPC buckets through a queue (``push_ipc``), or a torch.distributed broadcast
(``push_broadcast``). Module-level functions, so ``multiprocessing`` can spawn them (a
notebook cannot spawn functions defined in itself).
"""
from __future__ import annotations

import os
import queue
import time
from collections import deque

import torch

from course_lib.weights.checkpoint import CheckpointReader
from course_lib.weights.transports.dist import WeightBroadcaster
from course_lib.weights.transports.ipc import BucketSender
from course_lib.weights.transports.registered import RegisteredSender


class Channel:
    """One-way messages from one process to another over a pipe, with a queue's ``put``
    and ``get``: what the registered path's trainer and engine talk over. A
    ``multiprocessing.Queue`` hands each message to a feeder thread, which needs the GIL
    to write it: while the sending process goes on running Python (a trainer preparing
    its next step), the message can wait in that process for milliseconds, longer than a
    registered update of a small model takes. Here ``put`` writes the pipe itself. One
    writer and one reader; a message larger than the pipe's buffer (a registration)
    waits in ``put`` until the other side reads it. ``ctx``: a multiprocessing context
    (the spawn one, as for the trainer process)."""

    def __init__(self, ctx):
        self._reader, self._writer = ctx.Pipe(duplex=False)

    def put(self, item) -> None:
        self._writer.send(item)

    def get(self, timeout: float | None = None):
        if not self._reader.poll(timeout):
            raise queue.Empty(f"no message within {timeout} s")
        return self._reader.recv()


def share_cores(device: str) -> None:
    """A stand-in trainer on the CPU shares the machine with the engine: it takes half the
    cores. Both taking all of them makes their OpenMP threads spin against each other, and
    an engine-side copy of a few milliseconds then takes tens or hundreds."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))


def push_ipc(checkpoint_path, payloads, acks, bucket_bytes: int, device: str = "cpu", num_buffers: int = 2,
             rounds: int = 1) -> None:
    """Put serialized buckets on ``payloads``, at most ``num_buffers`` unacknowledged at a
    time (the next is packed while the engine applies the last); a bucket's buffer is
    reused only after its receipt comes back on ``acks``. Each round (one whole update)
    ends with ``None``; later rounds reuse the same buffers, as an RL trainer's steps do."""
    share_cores(device)
    tensors = [(n, t.to(device)) for n, t in CheckpointReader(checkpoint_path).iter_tensors()]
    sender = BucketSender(bucket_bytes, device=device, num_buffers=num_buffers)
    send_rounds(sender, tensors, payloads, acks, num_buffers, rounds)


def send_rounds(sender, tensors, payloads, acks, num_buffers: int, rounds: int) -> None:
    """Each round: put ``(receipt, payload)`` for every message of ``sender.payloads``, at
    most ``num_buffers`` unacknowledged (a buffer is reused only after its receipt comes
    back on ``acks``, in order), then ``None``."""
    in_flight: deque[int] = deque()

    def wait_for_ack():
        acked, expected = acks.get(), in_flight.popleft()
        if acked != expected:
            raise RuntimeError(f"acknowledged message {acked}, expected {expected}")
        sender.release(acked)

    for _ in range(rounds):
        for receipt, payload in sender.payloads(tensors):
            payloads.put((receipt, payload))
            in_flight.append(receipt)
            if len(in_flight) == num_buffers:
                wait_for_ack()  # frees the buffer the next message will be packed into
        while in_flight:
            wait_for_ack()
        payloads.put(None)


def push_registered(checkpoint_path, payloads, acks, bucket_bytes: int, device: str = "cpu", num_buffers: int = 2,
                    rounds: int = 1, resident: bool = False) -> None:
    """Register buffers once (``("register", payload)`` on ``payloads``; the engine puts
    the epoch on ``acks``), then, each round, put ``(receipt, message)`` per message
    (``update_weights_from_registered``'s ``buckets`` and ``epoch``), at most
    ``num_buffers`` unacknowledged; each round ends with ``None``. ``resident``: the
    weights live in the registered buffer (one message per round, nothing packed)."""
    share_cores(device)
    tensors = [(n, t.to(device)) for n, t in CheckpointReader(checkpoint_path).iter_tensors()]
    sender = RegisteredSender(tensors, bucket_bytes, device, num_buffers, resident)
    if resident:
        tensors = sender.adopt(tensors)  # the trainer's weights now live in the shared buffer
    payloads.put(("register", sender.registration()))
    sender.epoch = acks.get()
    send_rounds(sender, tensors, payloads, acks, num_buffers, rounds)


def push_broadcast(checkpoint_path, master_port: int, announcements, bucket_bytes: int, world_size: int = 2,
                   backend: str = "gloo", device: str = "cpu", group_name: str = "weight_update_group",
                   results=None, rounds: int = 1) -> None:
    """Be rank 0 of a weight-update group and broadcast the checkpoint in buckets; each
    bucket's request (names, dtypes, shapes) goes on ``announcements`` first. Each round
    (one whole update, as an RL trainer sends every step) ends with ``None`` and, with
    ``results``, puts that round's stats there."""
    share_cores(device)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator lives on the current device
    tensors = [(n, t.to(device)) for n, t in CheckpointReader(checkpoint_path).iter_tensors()]
    sender = WeightBroadcaster("127.0.0.1", master_port, world_size, group_name, backend, device, bucket_bytes)
    for _ in range(rounds):
        stats = sender.broadcast(tensors, announcements.put)
        announcements.put(None)
        if results is not None:
            results.put(stats)


def wait_for_exit(process, timeout: float = 120.0) -> int:
    """Wait for a trainer process to end; returns its exit code.

    Not ``process.join()``: with CPU shared memory, the child starts torch's
    ``torch_shm_manager`` daemon, which inherits the pipe ``join`` watches and keeps it
    open long after the child has exited. Polling the exit code (waitpid) does not care.
    """
    deadline = time.monotonic() + timeout
    while process.exitcode is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"trainer process {process.pid} still running after {timeout} s")
        time.sleep(0.02)
    return process.exitcode
