"""Chapter 05 scenarios, run on the learner's course_lib and on the reference (shared/twin.py).

Plain functions of JSON arguments (a seed, tensor specs, modes) that build tensors from the
seed, call one part and return JSON observations: the metadata, which error type, digests
of bytes (never raw addresses, which differ between processes: "is it the same buffer" is
asked instead), whether inputs and buffers were left alone on a refusal, the sender's
buffers (how many, how big, reused or new), and the bytes of every bucket still in flight.

A tensor spec is ``[dtype, shape, view]``: ``view`` "contiguous", "transposed" (a 2-D
transpose), "step" (every other row of a taller tensor), "expanded" (stride 0 along the
first dimension) or "offset" (a contiguous view starting inside a larger storage).
"""
from __future__ import annotations

import hashlib
import threading
from datetime import timedelta

import torch

from engine_scenarios import dense_copy, tensor_digest as digest, error_kind

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
          "int64": torch.int64, "uint8": torch.uint8, "float64": torch.float64, "bool": torch.bool,
          "int32": torch.int32}


def _values(gen, shape, dtype):
    if dtype == torch.bool:
        return torch.randn(shape, generator=gen) > 0
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 50).to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, shape, generator=gen, dtype=dtype)


def make_tensor(gen, dtype: str, shape: list, view: str) -> torch.Tensor:
    d, shape = DTYPES[dtype], tuple(shape)
    if view == "transposed" and len(shape) == 2:
        return _values(gen, (shape[1], shape[0]), d).t()
    if view == "step" and len(shape) >= 1:
        return _values(gen, (2 * shape[0],) + shape[1:], d)[::2]
    if view == "expanded" and len(shape) >= 1:
        return _values(gen, (1,) + shape[1:], d).expand(shape)
    if view == "offset":
        n = 1
        for s in shape:
            n *= s
        return _values(gen, (n + 3,), d)[3:].view(shape)
    return _values(gen, shape, d)


def make_pairs(seed: int, specs: list) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(f"t{i}.{dtype}", make_tensor(gen, dtype, shape, view)) for i, (dtype, shape, view) in enumerate(specs)]


def _slot_bytes(flat: torch.Tensor, start: int, end: int) -> str:
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= flat.numel()):
        return "out of range"
    return hashlib.sha256(flat[start:end].contiguous().numpy().tobytes()).hexdigest()[:16]


def _raw(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order (what its slot must hold)."""
    t = dense_copy(t)
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:16]


def _meta_rows(metadata) -> list:
    return [[m.name, list(m.shape), type(m.shape).__name__, str(m.dtype), m.start_idx, m.end_idx, m.numel]
            for m in metadata]


def pack_case(seed: int, specs: list, out_mode: str, extra: int = 0, device: str | None = None) -> dict:
    """``bucket.pack`` of tensors made from ``specs``, into ``out`` per ``out_mode``: "none"
    (a new buffer, on ``device`` when given), "exact" (a uint8 buffer exactly the bucket's
    size), "larger" (``extra`` bytes more), "short" (one byte short), "float32" (a float32
    buffer with room to spare) or "2d" (a 2-D uint8 buffer). Buffers start filled with 0xAB."""
    from course_lib.weights.transports import bucket
    torch.set_num_threads(1)
    pairs = make_pairs(seed, specs)
    need, end = 0, 0
    for _, t in pairs:  # the size the rules give (to make the caller's buffer), written out here
        start = -(-end // 16) * 16
        end = start + t.numel() * t.element_size()
        need = end
    out = {"none": None, "exact": lambda: torch.full((need,), 0xAB, dtype=torch.uint8),
           "larger": lambda: torch.full((need + extra,), 0xAB, dtype=torch.uint8),
           "short": lambda: torch.full((max(need - 1, 0),), 0xAB, dtype=torch.uint8),
           "float32": lambda: torch.full((need + extra + 1,), 7.0),
           "2d": lambda: torch.full((2, need + extra), 0xAB, dtype=torch.uint8)}[out_mode]
    out = out() if out is not None else None
    sent = [digest(t) for _, t in pairs]
    out_before = digest(out) if out is not None else None
    try:
        packed = bucket.pack(pairs, out=out,
                             **({"device": device} if device is not None else {}))
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        return {"raised": error_kind(exc), "inputs_unchanged": [digest(t) for _, t in pairs] == sent,
                "out_unchanged": out is None or digest(out) == out_before}
    flat, metadata = packed["flattened_tensor"], packed["metadata"]
    row = {"keys": sorted(packed), "metadata": _meta_rows(metadata),
           "flat": [str(flat.dtype), list(flat.shape), str(flat.device), flat.is_contiguous()],
           "storage_nbytes": flat.untyped_storage().nbytes(),
           "slots": [_slot_bytes(flat, m.start_idx, m.end_idx) for m in metadata],
           "slots_hold_the_tensors": [_slot_bytes(flat, m.start_idx, m.end_idx) == _raw(t)
                                      for m, (_, t) in zip(metadata, pairs)],
           "inputs_unchanged": [digest(t) for _, t in pairs] == sent}
    if out is not None:
        row.update(is_out=flat is out, starts_at_out=flat.data_ptr() == out.data_ptr(),
                   in_outs_storage=flat.untyped_storage().data_ptr() == out.untyped_storage().data_ptr())
    return row


# ---- validate ---------------------------------------------------------------------------------

CORRUPTIONS = ["none", "misaligned", "numel", "past_end", "negative_start", "start_after_end",
               "span", "span_long", "shifted_out", "shape_grown", "duplicate", "bool_numel", "float_start", "negative_dims", "bool_dim", "dtype_str",
               "not_metadata", "list_shape", "empty_list", "tuple_meta", "meta_dict", "flat_2d", "flat_meta_device",
               "flat_not_tensor"]


def validate_case(seed: int, specs: list, corruption: str, k: int, layout: str = "bytes") -> dict:
    """``bucket.validate`` on a bucket packed here from ``specs`` (byte layout: the sender's own
    rules, written out here; "elements": SGLang's, one float32 buffer with element offsets),
    with entry ``k`` (modulo the count) corrupted as ``corruption`` says. Returns which error
    type (or None) and whether the buffer and the metadata were left alone."""
    from course_lib.weights.transports.bucket import FlattenedTensorMetadata, validate
    torch.set_num_threads(1)
    pairs = make_pairs(seed, specs)
    meta, chunks, end = [], [], 0
    for name, t in pairs:
        if layout == "bytes":
            start = -(-end // 16) * 16
            chunks.append(torch.full((start - end,), 0x5A, dtype=torch.uint8))
            chunks.append(dense_copy(t).reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8))
            end = start + t.numel() * t.element_size()
        else:
            start = end
            chunks.append(t.contiguous().reshape(-1).to(torch.float32))
            end = start + t.numel()
        meta.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, start, end, t.numel()))
    flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8 if layout == "bytes" else torch.float32)
    corrupt(meta, corruption, k)
    metadata = list(meta)
    if corruption == "tuple_meta":
        metadata = tuple(metadata)
    elif corruption == "meta_dict":
        metadata = {m.name: m for m in metadata}
    elif corruption == "empty_list":
        metadata = []
    elif corruption == "not_metadata" and metadata:
        m = metadata[k % len(metadata)]
        metadata[k % len(metadata)] = {f: getattr(m, f) for f in ("name", "shape", "dtype", "start_idx", "end_idx", "numel")}
    arg = flat
    if corruption == "flat_2d":
        arg = flat.view(1, -1)
    elif corruption == "flat_meta_device":
        arg = torch.empty(flat.shape, dtype=flat.dtype, device="meta")
    elif corruption == "flat_not_tensor":
        arg = flat.tolist()
    before_flat, before_meta = digest(flat), repr(metadata)
    try:
        returned = validate(arg, metadata)
        row = {"returned": repr(returned)}
    except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
        row = {"raised": error_kind(exc)}
    row.update(flat_unchanged=digest(flat) == before_flat, metadata_unchanged=repr(metadata) == before_meta,
               entries=len(meta))
    return row


def corrupt(meta: list, corruption: str, k: int) -> None:
    """Corrupt entry ``k % len(meta)`` in place (nothing to corrupt in an empty bucket)."""
    if not meta:
        return
    shift = -(-meta[-1].end_idx // 16) * 16 + 16  # past the end, alignment kept
    i = k % len(meta)
    m = meta[i]
    span = m.end_idx - m.start_idx
    # No overlap corruption: the contract neither allows nor forbids two entries sharing
    # bytes, so a learner who refuses them is as right as the reference, which accepts them.
    if corruption == "misaligned":
        m.start_idx, m.end_idx = m.start_idx + 1, m.end_idx + 1
    elif corruption == "numel":
        m.numel += 1
    elif corruption == "past_end":
        m.end_idx += 16 * (1 + k % 3)
    elif corruption == "negative_start":
        m.start_idx = -m.end_idx - 1
    elif corruption == "start_after_end":
        m.start_idx, m.end_idx = m.end_idx + 1, m.end_idx
    elif corruption == "span":
        m.end_idx = m.start_idx + max(span - 1, 0) if span else m.start_idx + 1
    elif corruption == "span_long":  # one byte (element) more: still inside the buffer when padding follows
        m.end_idx += 1
    elif corruption == "shifted_out":  # the right span, moved wholly past the buffer's end
        m.start_idx, m.end_idx = m.start_idx + shift, m.end_idx + shift
    elif corruption == "shape_grown":  # numel and span agree; the shape says twice as many
        m.shape = tuple(m.shape) + (2,)
    elif corruption == "duplicate":
        m.name = meta[(i + 1) % len(meta)].name if len(meta) > 1 else m.name
        if len(meta) == 1:
            meta.append(meta[0])
    elif corruption == "bool_numel" and m.numel in (0, 1):
        m.numel = bool(m.numel)
    elif corruption == "float_start":
        m.start_idx = float(m.start_idx)
    elif corruption == "negative_dims":
        if len(m.shape) == 2 and m.shape[0] and m.shape[1]:
            m.shape = (-m.shape[0], -m.shape[1])
        else:
            m.shape = tuple(m.shape) + (-1,)
    elif corruption == "bool_dim":
        m.shape = tuple(m.shape) + (True,)
    elif corruption == "dtype_str":
        m.dtype = str(m.dtype).removeprefix("torch.")
    elif corruption == "list_shape":
        m.shape = list(m.shape)


# ---- the IPC sender ---------------------------------------------------------------------------

def sender_trace(seed: int, bucket_bytes: int, num_buffers: int, ops: list) -> list:
    """A ``BucketSender`` driven as an engine would, acknowledgements in the order ``ops`` says:

        ["round", specs]   a new ``payloads(...)`` over tensors [dtype, numel] (1-D, from the seed)
        ["next"]           the next payload of the current round (decoded and held, as an engine does)
        ["release", j]     release held bucket number j (modulo how many are held); with none held,
                           a receipt never issued (KeyError)

    After each: what it returned or raised; for a payload, the receipt, its metadata, whether
    every slot holds its tensor's bytes, which buffer carried it (a slot number, or "own");
    then the sender's buffers (allocated or not, their sizes, whether each is the one first
    made for its slot), what it holds in flight, and whether every held bucket's bytes are
    still what they were when it was handed over."""
    from course_lib.weights.transports import bucket, safe_pickle
    from course_lib.weights.transports.ipc import BucketSender
    torch.set_num_threads(1)
    sender = BucketSender(bucket_bytes=bucket_bytes, num_buffers=num_buffers)
    first: dict[int, object] = {}  # slot -> the buffer first seen there
    stream, pairs, held, trace = None, [], [], []
    for i, op in enumerate(ops):
        entry = {}
        try:
            if op[0] == "round":
                gen = torch.Generator().manual_seed(seed * 100 + i)
                pairs = [(f"r{i}.w{j}", _values(gen, (n,), DTYPES[d])) for j, (d, n) in enumerate(op[1])]
                stream = sender.payloads(pairs)
                entry["returned"] = None
            elif op[0] == "next":
                if stream is None:
                    raise StopIteration
                receipt, payload = next(stream)
                decoded = safe_pickle.deserialize(payload)
                flat = decoded["flattened_tensor"]
                views = bucket.unpack(decoded)
                by_name = dict(pairs)
                slot = [s for s, b in enumerate(sender._buffers)
                        if b is not None and b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()]
                entry["returned"] = {
                    "receipt": receipt, "metadata": _meta_rows(decoded["metadata"]),
                    "holds_the_tensors": [n in by_name and digest(v) == digest(by_name[n]) for n, v in views],
                    "buffer": slot[0] if slot else "own", "flat_numel": flat.numel()}
                held.append((receipt, views, [digest(v) for _, v in views]))
            elif op[0] == "release":
                if held:
                    receipt = held.pop(op[1] % len(held))[0]
                else:
                    receipt = 10_000 + op[1]
                entry["returned"] = sender.release(receipt)
            else:
                raise ValueError(f"unknown operation {op!r}")
        except StopIteration:
            entry["raised"] = "StopIteration"
            stream = None
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry["raised"] = error_kind(exc)
        buffers = []
        for s, b in enumerate(sender._buffers):
            if b is not None:
                first.setdefault(s, b)
            buffers.append(None if b is None else [b.numel(), str(b.dtype), b.dim(), first[s] is b])
        entry.update(buffers=buffers, in_use=sorted(sender._in_use.items()), oversize=sorted(sender._oversize),
                     num_alive=sender.num_alive,
                     held_intact=[[r, [digest(v) for _, v in views] == want] for r, views, want in held])
        trace.append(entry)
    return trace


# ---- the broadcast receiver -------------------------------------------------------------------

def _bucket_bytes(pairs, gen) -> torch.Tensor:
    """The byte-layout bucket of ``pairs`` by the chapter's rules (16-byte aligned starts),
    written out here; padding random."""
    end, pieces = 0, []
    for _, t in pairs:
        start = -(-end // 16) * 16
        pieces.append(torch.randint(0, 256, (start - end,), generator=gen, dtype=torch.uint8))
        pieces.append(dense_copy(t).reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8))
        end = start + t.numel() * t.element_size()
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


BAD_REQUESTS = ["unknown_dtype", "negative_dim", "float_dim", "bool_dim", "lengths", "dtype_int", "torch_attr"]


def _bad_request(kind: str, names, dtypes, shapes):
    names, dtypes, shapes = list(names) or ["x"], list(dtypes) or ["float32"], [list(s) for s in shapes] or [[2]]
    if kind == "unknown_dtype":
        dtypes[-1] = "float33"
    elif kind == "negative_dim":
        shapes[-1] = shapes[-1] + [-2]
    elif kind == "float_dim":
        shapes[-1] = shapes[-1] + [2.0]
    elif kind == "bool_dim":
        shapes[-1] = shapes[-1] + [True]
    elif kind == "lengths":
        names = names + ["extra"]
    elif kind == "dtype_int":
        dtypes[-1] = 7
    elif kind == "torch_attr":  # a name torch has that is no dtype
        dtypes[-1] = "Size"
    return names, dtypes, shapes


def receive_trace(seed: int, ops: list) -> list:
    """``dist.receive_bucket`` on rank 1 of a real 2-process-style gloo group (rank 0 is a
    thread here that broadcasts byte buckets it packs by the rules, written out here):

        ["bucket", specs, form]  rank 0 sends a bucket of tensors [dtype, shape, view]; rank 1
                                 announces the dtypes as ``form`` says: "name" ("bfloat16"),
                                 "torch" ("torch.bfloat16"), "dtype" (torch.bfloat16) or "mixed"
        ["bad", kind, specs]     a bad announcement (``BAD_REQUESTS``) handed to receive_bucket
                                 with no group at all: it must refuse before touching one

    After each: the views (names, dtypes, shapes, devices, bytes), the receive buffer's size,
    whether it is a buffer of its own (not any earlier call's), and whether every earlier
    call's views still hold their bytes."""
    from course_lib.weights.transports import dist
    torch.set_num_threads(1)
    sends = []
    plan = []
    for i, op in enumerate(ops):
        if op[0] == "bucket":
            gen = torch.Generator().manual_seed(seed * 100 + i)
            pairs = [(f"b{i}.t{j}.{d}", make_tensor(gen, d, shape, view)) for j, (d, shape, view) in enumerate(op[1])]
            plan.append(pairs)
            sends.append(_bucket_bytes(pairs, gen))
    errors = []
    # Rank 0's store listens before anyone connects, on a port the system picks (0): no
    # free port is chosen first and bound later, so no other process can take it between.
    master = None
    if sends:  # a group only for real buckets (bad announcements must never reach one)
        master = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                                            timeout=timedelta(seconds=20))

    def rank0():
        try:
            opts = torch.distributed.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=20)
            opts._devices = [torch.distributed.ProcessGroupGloo.create_default_device()]
            group = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("differential", master),
                                                       0, 2, opts)
            for buf in sends:
                dist.broadcast_async(group, buf).wait()
        except Exception as exc:  # noqa: BLE001 - reported in the trace
            errors.append(error_kind(exc))

    thread = threading.Thread(target=rank0, daemon=True)
    group = None
    if sends:
        thread.start()
        group, _ = dist.new_group("127.0.0.1", master.port, 1, 2, "differential", "gloo", timeout_s=20)
    trace, earlier, k = [], [], 0
    for i, op in enumerate(ops):
        entry = {}
        try:
            if op[0] == "bucket":
                pairs = plan[k]
                k += 1
                names = [n for n, _ in pairs]
                forms = [op[2] if op[2] != "mixed" else ("name", "torch", "dtype")[j % 3] for j in range(len(pairs))]
                dtypes = [{"name": str(t.dtype).removeprefix("torch."), "torch": str(t.dtype), "dtype": t.dtype}[f]
                          for f, (_, t) in zip(forms, pairs)]
                shapes = [list(t.shape) for _, t in pairs]
                views = dist.receive_bucket(group, names, dtypes, shapes, "cpu")
                storages = {v.untyped_storage().data_ptr() for _, v in views if v.numel()}
                entry["returned"] = {
                    "views": [[n, str(v.dtype), list(v.shape), str(v.device), digest(v)] for n, v in views],
                    "as_sent": [digest(v) == digest(t) for (_, v), (_, t) in zip(views, pairs)],
                    "buffer_nbytes": sorted({v.untyped_storage().nbytes() for _, v in views if v.numel()}),
                    "own_buffer": not storages & {p for _, _, ps in earlier for p in ps}}
                earlier.append((views, [digest(v) for _, v in views], storages))
            else:
                pairs = make_pairs(seed + i, op[2])
                args = _bad_request(op[1], [n for n, _ in pairs], [str(t.dtype) for _, t in pairs],
                                    [list(t.shape) for _, t in pairs])
                entry["returned"] = repr(dist.receive_bucket(None, *args, "cpu"))
        except Exception as exc:  # noqa: BLE001 - which error, compared with the reference's
            entry["raised"] = error_kind(exc)
        entry["earlier_intact"] = [[digest(v) for _, v in views] == want for views, want, _ in earlier]
        trace.append(entry)
    if sends:
        thread.join(25)
    trace.append({"sender_errors": errors, "sender_done": not thread.is_alive()})
    return trace
