"""Weights over a torch.distributed group: the trainer (rank 0) broadcasts, engines receive.

Both sides build their own process group straight from a TCP store (no global default
group, so a trainer's training groups and this one never mix); gloo on CPU, NCCL on GPUs.
The trainer packs tensors into fixed-size byte buffers used in turn (two by default):
while one buffer is on the wire, the next bucket is packed into the other, so packing
overlaps sending. Before each bucket it tells the engines what is coming (names, dtypes,
shapes: SGLang's ``update_weights_from_distributed`` fields), so they can validate and
allocate a receive buffer of the right size.

An engine that receives the same buckets step after step keeps its receive buffers
(``ReceivePool``, one per group): each announced layout lands in the same buffer every
step, so the engine's copy table for it (``weights/commit/bucket_cache.py``) is built once, as
for a registered trainer buffer, and every later bucket is one broadcast and one copy.
"""
from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from course_lib import settings
from course_lib.dtypes import dtype_name
from course_lib.weights.transports import bucket

DEFAULT_BUCKET_BYTES = 64 << 20
# joining a group: reaching the store and every rank's rendezvous (the default of
# COURSE_LIB_GROUP_CONNECT_TIMEOUT_S, see settings.py)
CONNECT_TIMEOUT_S = settings.DEFAULT_GROUP_CONNECT_TIMEOUT_S


def connect_timeout_s() -> float:
    """How long joining a group may take: COURSE_LIB_GROUP_CONNECT_TIMEOUT_S, else CONNECT_TIMEOUT_S.
    Short on purpose: an engine joins on its serving thread, and a closed port or a trainer
    that never comes must not stall generation for the collective timeout (300 s)."""
    return settings.group_connect_timeout_s()


def free_port() -> int:
    """A TCP port free on the loopback right now, for a group's rendezvous store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
              backend: str, timeout_s: float = 300.0, connect_timeout: float | None = None):
    """A process group of its own, rendezvousing through a TCP store hosted by rank 0.
    ``connect_timeout`` (default ``connect_timeout_s()``) bounds the join; ``timeout_s``
    bounds each collective and store call once joined."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    timeout = timedelta(seconds=timeout_s)
    joining = timedelta(seconds=min(timeout_s, connect_timeout or connect_timeout_s()))
    tcp = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                        timeout=joining, wait_for_workers=False)
    store = dist.PrefixStore(group_name, tcp)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        group = dist.ProcessGroupGloo(store, rank, world_size, opts)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    tcp.set_timeout(timeout)  # joined: later store calls (NCCL's lazy set-up) get the full timeout
    return group, store


def broadcast_async(group, tensor: torch.Tensor, root: int = 0):
    """Start a broadcast of ``tensor`` from ``root`` on a backend object; returns its Work."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return group.broadcast([tensor], opts)


def bucket_plan(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Split tensors into buckets that each fit ``bucket_bytes`` (a larger tensor goes alone):
    ``bucket.group_into_buckets``, under the name the broadcaster and remote seeding use."""
    return list(bucket.group_into_buckets(named_tensors, bucket_bytes))


def describe(group) -> dict:
    """The request an engine needs before receiving this bucket (SGLang's field names)."""
    return {"names": [n for n, _ in group], "dtypes": [dtype_name(t.dtype) for _, t in group],
            "shapes": [list(t.shape) for _, t in group], "load_format": "flattened_bucket"}


class WeightBroadcaster:
    """The trainer's end: rank 0 of a weight-update group."""

    def __init__(self, master_address: str, master_port: int, world_size: int, group_name: str = "weights",
                 backend: str = "gloo", device="cpu", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 num_buffers: int = 2):
        self.group, self._store = new_group(master_address, master_port, 0, world_size, group_name, backend)
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_buffers)]
        self.stats: dict = {}

    def broadcast(self, named_tensors, announce: Callable[[dict], None]) -> dict:
        """Send every tensor; ``announce(request)`` is called before each bucket goes out
        (e.g. it posts ``/update_weights_from_distributed``). Returns timing and byte counts."""
        plan = bucket_plan(named_tensors, self.bucket_bytes)
        works: list = [None] * len(self.buffers)
        t0 = time.perf_counter()
        pack_s, nbytes = 0.0, 0
        for i, group in enumerate(plan):
            slot = i % len(self.buffers)
            if works[slot] is not None:
                works[slot].wait()  # this buffer's previous bucket has left; reuse it
            need = bucket.bucket_nbytes(group)
            buf = self.buffers[slot] if need <= self.bucket_bytes else torch.empty(need, dtype=torch.uint8, device=self.device)
            tp = time.perf_counter()
            # No wait for the packing: the broadcast is ordered after it on the device (a
            # collective waits for the work queued before it), and the host announces meanwhile.
            packed = bucket.pack(group, out=buf)
            pack_s += time.perf_counter() - tp
            announce(describe(group))
            works[slot] = broadcast_async(self.group, packed["flattened_tensor"])
            nbytes += packed["flattened_tensor"].numel()
        for w in works:
            if w is not None:
                w.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the last bytes have left
        total = time.perf_counter() - t0
        self.stats = {"buckets": len(plan), "bytes": nbytes, "seconds": total, "pack_launch_seconds": pack_s,
                      "gb_per_s": nbytes / total / 1e9 if total else 0.0}
        return self.stats

    def close(self) -> None:
        self.group = None
        self._store = None


def receive_bucket(group, names, dtypes, shapes, device) -> list[tuple[str, torch.Tensor]]:
    """The engine's end of one broadcast bucket: (name, tensor) views of the bytes rank 0 sent.

    ``names``, ``dtypes`` and ``shapes`` are what the trainer announced for this bucket
    (``describe``): one each per tensor, in the sender's order; a dtype is a
    ``torch.dtype`` or its name with or without ``"torch."`` (``"bfloat16"``); a shape is
    a list of non-negative ints.

    Promises:
    - anything else (lengths that differ, an unknown dtype, a negative or non-integer
      size) raises ``ValueError`` naming what is wrong, before this rank joins the
      collective (so a bad announcement never leaves the sender waiting half way);
    - this rank takes part in exactly one broadcast from rank 0 per call, with a buffer of
      exactly the byte length the sender packed (the layout of ``weights/transports/bucket.py``, which
      both ends derive from the announcement; any other length breaks the collective),
      an empty bucket included (zero bytes; returns ``[]``);
    - it returns validated (name, tensor) views into that buffer on ``device``, with the
      announced names, dtypes and shapes, in order;
    - every call's buffer is its own: views returned by an earlier call stay valid and
      unchanged (the caller may still be using them).
    """
    # BEGIN EXERCISE ch05.receive_broadcast
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must have the same length")
    parsed = []
    for name, d, shape in zip(names, dtypes, shapes):
        if isinstance(d, str):
            d = getattr(torch, d.removeprefix("torch."), None)
        if not isinstance(d, torch.dtype):
            raise ValueError(f"{name}: dtype {dtypes[len(parsed)]!r} is not a torch dtype")
        if not all(type(s) is int and s >= 0 for s in shape):
            raise ValueError(f"{name}: shape {shape!r} is not a list of non-negative integers")
        parsed.append(d)
    meta = bucket.layout(names, parsed, shapes)
    flat = torch.empty(meta[-1].end_idx if meta else 0, dtype=torch.uint8, device=device)
    broadcast_async(group, flat).wait()
    return bucket.unpack({"flattened_tensor": flat, "metadata": meta})
    # END EXERCISE


RECEIVE_STEP = "ch05.receive_broadcast"  # what ``ReceivePool`` stands in for (``receive_bucket``)
MAX_POOL_LAYOUTS = 4096                  # announced layouts a pool remembers (a step's buckets, many times over)


class ReceivePool:
    """The engine's own receive buffers for one group's flattened buckets, kept between steps.

    A trainer announces the same buckets (names, dtypes, shapes) in the same order every
    step. The first time a layout is announced it is given a buffer (``num_buffers`` used
    in turn, in order of first announcement, so consecutive buckets land in different
    buffers); every later announcement of it lands in that buffer again. A buffer grows
    to the largest bucket given to it; a grown buffer is new memory, and ``buffer_for``
    returns the storage it replaced, so the caller forgets what it built on that one.
    The memory held: ``num_buffers`` buffers of the largest bucket, until ``clear``
    (the group is destroyed).

    On a GPU (``overlap``) a bucket is received on a stream of the pool's own, which waits
    only for the last copy out of the same buffer (``read_launched``), not for everything
    the engine's stream has queued: the next bucket arrives while the last one is still
    being copied into the weights, and the engine's stream waits for the bytes before it
    reads them. Nothing waits on the host."""

    def __init__(self, device, num_buffers: int = 2, overlap: bool = True):
        self.device = torch.device(device)
        self.overlap = overlap and self.device.type == "cuda"
        self.buffers: list[torch.Tensor | None] = [None] * num_buffers
        self.read_done: list = [None] * num_buffers         # per buffer: the last copy out of it (CUDA event)
        self.layouts: dict[tuple, tuple[list, int]] = {}  # announcement -> (metadata, slot)
        self._next_slot = 0
        self._stream = None

    def buffer_for(self, names, dtypes, shapes):
        """``(slot, flat, metadata, replaced)``: which buffer this announcement's bucket is
        received into and its bytes (a 1-D uint8 tensor of exactly the bucket's length,
        always the same memory for the same layout unless the buffer grew), its byte layout
        (``bucket.layout``), and the storage a grown buffer replaced (None if none).
        ``dtypes``: torch dtypes."""
        key = (tuple(names), tuple(dtypes), tuple(tuple(int(x) for x in s) for s in shapes))
        known = self.layouts.get(key)
        if known is None:
            if len(self.layouts) >= MAX_POOL_LAYOUTS:
                self.layouts.pop(next(iter(self.layouts)))
            known = self.layouts[key] = (bucket.layout(names, dtypes, shapes), self._next_slot)
            self._next_slot = (self._next_slot + 1) % len(self.buffers)
        metadata, slot = known
        need = metadata[-1].end_idx if metadata else 0
        buf, replaced = self.buffers[slot], None
        if buf is None or buf.numel() < need:
            replaced = None if buf is None else buf.untyped_storage()
            buf = self.buffers[slot] = torch.empty(need, dtype=torch.uint8, device=self.device)
        return slot, buf[:need], metadata, replaced

    def receive(self, group, slot: int, flat: torch.Tensor) -> None:
        """Take part in rank 0's broadcast into ``flat`` (buffer ``slot``); afterwards the
        engine's current stream sees the bytes (on a CPU: they are there)."""
        if not self.overlap:
            broadcast_async(group, flat).wait()
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if self.read_done[slot] is not None:  # the last copy out of this buffer has been queued: wait for it
            self._stream.wait_event(self.read_done[slot])
        with torch.cuda.stream(self._stream):
            broadcast_async(group, flat).wait()  # the pool's stream waits for the collective
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def read_launched(self, slot: int) -> None:
        """Everything that reads buffer ``slot`` is queued on the current stream: a later
        receive into it waits for that, and for nothing else."""
        if self.overlap:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.read_done[slot] = event

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)

    def clear(self) -> list:
        """Free the buffers; returns their storages (for the caller to forget)."""
        storages = [b.untyped_storage() for b in self.buffers if b is not None]
        self.buffers = [None] * len(self.buffers)
        self.read_done = [None] * len(self.buffers)
        self.layouts.clear()
        return storages
