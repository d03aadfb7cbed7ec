"""Requantization in two fused passes on the GPU (Triton), equal bit for bit to the
reference quantizers in ``quant.py``.

The reference ``quantize_fp8_block`` is a chain of whole-tensor operations (a float32
copy, a padded copy, ``abs``, ``amax``, a divide, a clamp, a cast): about 50 bytes of
memory traffic per weight element, against 3 for reading a bf16 weight and writing its
fp8 value. Here one kernel computes every tile's (or row's) scale and counts its
non-finite values, reading the weight once; after the one check that there are none
(NaN or inf is refused, as the reference refuses it), a second kernel reads the weight again and
writes the quantized values. Same float32 arithmetic in the same order (the
scale as torch computes it, correctly rounded division, round-half-to-even, the same clamp), so the same bits.

The engine uses these only where they agree with the quantizers it would otherwise call:
``agrees_with`` runs both on probe weights (zero tiles, ties, ragged edges, subnormal
results) the first time, and a quantizer that differs keeps its own path (a learner's
part is never routed around: a wrong one is what runs, and what the tests then see).

Each pass takes several weights in one launch (``scales_pass``, ``quant_pass``): every
program finds its weight in a small table, so a whole update's shards are quantized by
two launches, not two per shard (at ~8B, 250 shards, launching a kernel per shard kept
the GPU waiting for the CPU). The addresses are offsets from the first weight and the
first destination, declared multiples of 16 bytes where the host finds them so: read
from a table with no such declaration, loads and stores were narrower and FP8 ran at
15% of a device copy instead of 29% (results/h200-2026-12-01d/). The scales go into one
flat buffer, the values into each weight's destination, which may be a row range of a
live ``qweight`` (its own row stride). ``direct_quant.py`` uses them to requantize a hot update straight into the
kernel tensors; the quantizers below are the same passes over one weight into new
tensors. Same arithmetic per tile or row whichever way, so the same bits.
"""
from __future__ import annotations

import torch

# The kernels spell out 448 (largest finite e4m3fn) and 127 (int8): Triton kernels read
# no Python globals. A scale is the maximum times the reciprocal, as torch computes
# ``amax / 448.0`` (a division by a Python number is a multiplication by its reciprocal);
# the weight divided by its scale is a correctly rounded division, as torch's is.

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    # Every kernel takes several weights at once (one launch per pass for a whole update):
    # ``table`` holds a row of int64 per weight (see _table) and ``starts`` where each
    # weight's programs begin (ascending, from 0). A program finds its weight by binary
    # search, then does exactly what the one-weight kernel would on that weight; its
    # scale and non-finite count go to position program_id of the flat ``scale``/``bad``
    # buffers (each weight's [rows] or [row tiles, column tiles] one after another).
    # Addresses are offsets from the first weight ``w0`` and the first destination ``q0``
    # (arguments, which the compiler knows to be 16-byte aligned); with ``ALIGNED`` every
    # offset, row stride and column count is declared a multiple of 16 bytes, as the host
    # checked, so loads and stores may be 16 bytes wide, as they are for one weight passed
    # as an argument.
    @triton.jit
    def _which(starts, count, pid, STEPS: tl.constexpr):
        """(the weight, the program's index inside it): the last weight starting at or before pid."""
        lo = pid * 0
        hi = count - 1
        for _ in range(STEPS):
            mid = (lo + hi + 1) // 2
            go = tl.load(starts + mid) <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid - 1)
        return lo, pid - tl.load(starts + lo)

    @triton.jit
    def _weight(table, g, w0, VEC: tl.constexpr, ALIGNED: tl.constexpr):
        """(weight g's first element, its columns, its row stride, column tiles, rows)."""
        row = table + g * 7
        w_off, k, stride_w = tl.load(row), tl.load(row + 2), tl.load(row + 3)
        if ALIGNED:
            w_off, stride_w, k = tl.multiple_of(w_off, VEC), tl.multiple_of(stride_w, VEC), tl.multiple_of(k, 16)
        return w0 + w_off, k, stride_w, tl.load(row + 5), tl.load(row + 6)

    @triton.jit
    def _destination(table, g, q0, ALIGNED: tl.constexpr):
        """(weight g's destination, its row stride); one byte per element."""
        row = table + g * 7
        q_off, stride_q = tl.load(row + 1), tl.load(row + 4)
        if ALIGNED:
            q_off, stride_q = tl.multiple_of(q_off, 16), tl.multiple_of(stride_q, 16)
        return q0 + q_off, stride_q

    @triton.jit
    def _fp8_tile_scales(table, starts, count, w0, scale, bad, STEPS: tl.constexpr, BLOCK: tl.constexpr,
                         VEC: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        g, t = _which(starts, count, pid, STEPS)
        w, k, stride_w, kb, n = _weight(table, g, w0, VEC, ALIGNED)
        i, j = t // kb, t % kb
        rows = i * BLOCK + tl.arange(0, BLOCK)
        cols = j * BLOCK + tl.arange(0, BLOCK)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        x = tl.load(w + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        # x - x is 0 for every finite x and NaN for NaN and +-inf: count the tile's non-finite values.
        tl.store(bad + pid, tl.sum(tl.sum(((x - x) != 0).to(tl.int32), axis=1), axis=0))
        tl.store(scale + pid, tl.where(amax > 0, amax * (1.0 / 448.0), 1.0))

    @triton.jit
    def _fp8_tile_quant(table, starts, count, w0, q0, scale, STEPS: tl.constexpr, BLOCK: tl.constexpr,
                        VEC: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        g, t = _which(starts, count, pid, STEPS)
        w, k, stride_w, kb, n = _weight(table, g, w0, VEC, ALIGNED)
        q, stride_q = _destination(table, g, q0, ALIGNED)
        i, j = t // kb, t % kb
        rows = i * BLOCK + tl.arange(0, BLOCK)
        cols = j * BLOCK + tl.arange(0, BLOCK)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        x = tl.load(w + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(scale + pid)
        v = tl.minimum(tl.maximum(libdevice.div_rn(x, s), -448.0), 448.0)
        tl.store(q + rows[:, None] * stride_q + cols[None, :], v.to(tl.float8e4nv), mask=mask)

    @triton.jit
    def _int8_row_scales(table, starts, count, w0, scale, bad, STEPS: tl.constexpr, BLOCK: tl.constexpr,
                         VEC: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        g, r = _which(starts, count, pid, STEPS)
        w, k, stride_w, _, _ = _weight(table, g, w0, VEC, ALIGNED)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        nonfinite = tl.zeros((BLOCK,), dtype=tl.int32)
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(w + r * stride_w + cols, mask=cols < k, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
            nonfinite += ((x - x) != 0).to(tl.int32)
        m = tl.max(amax, axis=0)
        tl.store(bad + pid, tl.sum(nonfinite, axis=0))
        tl.store(scale + pid, tl.where(m > 0, m * (1.0 / 127.0), 1.0))

    @triton.jit
    def _int8_row_quant(table, starts, count, w0, q0, scale, STEPS: tl.constexpr, BLOCK: tl.constexpr,
                        VEC: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        g, r = _which(starts, count, pid, STEPS)
        w, k, stride_w, _, _ = _weight(table, g, w0, VEC, ALIGNED)
        q, stride_q = _destination(table, g, q0, ALIGNED)
        s = tl.load(scale + pid)
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(w + r * stride_w + cols, mask=cols < k, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(libdevice.rint(libdevice.div_rn(x, s)), -127.0), 127.0)
            tl.store(q + r * stride_q + cols, v.to(tl.int8), mask=cols < k)


def available(w: torch.Tensor) -> bool:
    """Whether the fused kernels can quantize ``w`` (a 2-D float tensor on a GPU, rows contiguous)."""
    return (triton is not None and w.is_cuda and w.dim() == 2 and w.is_floating_point()
            and w.stride(1) == 1 and w.numel() > 0)


def _refuse_non_finite(bad: torch.Tensor, what: str) -> None:
    if bad.any():  # the one synchronization
        raise ValueError(f"{what}: the weight holds NaN or infinite values")


# ---- the two passes over several weights, into tensors the caller gives (weights/commit/direct_quant.py
# writes a hot update's shards into a layer's live rows with them); the quantizers below are the
# two passes over one weight into new tensors -------------------------------------------------

BLOCK = {"fp8": 128, "int8": 1024}   # tile side (fp8); columns per step of a row (int8)


def scale_shape(kind: str, w: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``w``'s scales: [rows] (int8) or [row tiles, column tiles] (fp8)."""
    n, k = w.shape
    return (n,) if kind == "int8" else (-(-n // 128), -(-k // 128))


def _table(kind: str, ws, qs=None) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    """(table, starts, programs, binary-search steps, aligned) for weights ``ws`` (same dtype
    and device, rows contiguous) and their destinations ``qs`` (one byte per element, rows
    contiguous, any row stride). A row: the weight's offset in elements from ``ws[0]``,
    the destination's in bytes from ``qs[0]``, columns, the two row strides, column tiles,
    rows. ``aligned``: every offset, row stride and column count is a multiple of 16 bytes."""
    rows, starts, total = [], [], 0
    size, base = ws[0].element_size(), ws[0].data_ptr()
    qbase = qs[0].data_ptr() if qs is not None else 0
    aligned = base % 16 == 0 and qbase % 16 == 0
    for i, w in enumerate(ws):
        q = qs[i] if qs is not None else None
        n, k = w.shape
        assert w.dtype == ws[0].dtype and w.stride(1) == 1 and (q is None or (q.shape == w.shape and q.stride(1) == 1))
        w_bytes = w.data_ptr() - base
        assert w_bytes % size == 0, "a weight's address is not a whole number of elements from the first one's"
        q_bytes, stride_q = (q.data_ptr() - qbase, q.stride(0)) if q is not None else (0, 0)
        aligned = aligned and w_bytes % 16 == 0 and (w.stride(0) * size) % 16 == 0 and k % 16 == 0 \
            and q_bytes % 16 == 0 and stride_q % 16 == 0
        shape = scale_shape(kind, w)
        rows.append((w_bytes // size, q_bytes, k, w.stride(0), stride_q, shape[-1], n))
        starts.append(total)
        total += torch.Size(shape).numel()
    device = ws[0].device
    table, first = (torch.tensor(x, dtype=torch.int64, device=device) for x in (rows, starts))
    return table, first, total, max(1, (len(ws) - 1).bit_length()), aligned


def scales_pass(kind: str, ws, scale: torch.Tensor, bad: torch.Tensor) -> None:
    """Pass 1 over every weight of ``ws`` in one launch: each weight's scales and non-finite
    counts, one weight after another, into the flat ``scale`` (float32) and ``bad`` (int32)
    (as many as the weights' ``scale_shape`` hold in all). No synchronization."""
    table, starts, total, steps, aligned = _table(kind, ws)
    assert scale.is_contiguous() and bad.is_contiguous() and scale.numel() == bad.numel() == total
    kernel = _fp8_tile_scales if kind == "fp8" else _int8_row_scales
    kernel[(total,)](table, starts, len(ws), ws[0], scale, bad, STEPS=steps, BLOCK=BLOCK[kind],
                     VEC=16 // ws[0].element_size(), ALIGNED=aligned)


def quant_pass(kind: str, ws, qs, scale: torch.Tensor) -> None:
    """Pass 2 over every weight of ``ws`` in one launch: each divided by its scales (from
    ``scale_pass``'s ``scale``) into its destination in ``qs`` (float8_e4m3fn or int8,
    rows contiguous, any row stride: a row range of a live ``qweight``)."""
    table, starts, total, steps, aligned = _table(kind, ws, qs)
    assert scale.is_contiguous() and scale.numel() == total
    kernel = _fp8_tile_quant if kind == "fp8" else _int8_row_quant
    kernel[(total,)](table, starts, len(ws), ws[0], qs[0], scale, STEPS=steps, BLOCK=BLOCK[kind],
                     VEC=16 // ws[0].element_size(), ALIGNED=aligned)


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_fp8_block``'s result, in two kernel passes (see the module docstring)."""
    assert block == BLOCK["fp8"], "the kernels tile by 128"
    return _quantize("fp8", w, torch.float8_e4m3fn, "quantize_fp8_block")


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_int8_per_channel``'s result, in two kernel passes."""
    return _quantize("int8", w, torch.int8, "quantize_int8_per_channel")


def _quantize(kind: str, w: torch.Tensor, qdtype: torch.dtype, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.empty(scale_shape(kind, w), dtype=torch.float32, device=w.device)
    bad = torch.empty(scale.shape, dtype=torch.int32, device=w.device)
    scales_pass(kind, [w], scale, bad)
    _refuse_non_finite(bad, what)
    q = torch.empty(w.shape, dtype=qdtype, device=w.device)
    quant_pass(kind, [w], [q], scale)
    return q, scale


FUSED = {"fp8": quantize_fp8_block, "int8": quantize_int8_per_channel}


def probe_weights(device, dtype) -> list[torch.Tensor]:
    """Weights that tell two quantizers apart: ragged edges, an all-zero tile and row,
    values whose quantized form is a tie, tiny values (subnormal results), large ones."""
    g = torch.Generator(device="cpu").manual_seed(0)
    ragged = torch.randn(300, 200, generator=g) * 0.05
    ragged[:128, :128] = 0.0                                         # an all-zero tile
    ragged[200] = 0.0                                                 # an all-zero row
    ties = torch.arange(-384, 384, dtype=torch.float32).reshape(6, 128) / 2 + 0.5   # x.5 steps
    ties[:, 0] = 127.0                                                # scale 1 for int8: round(x.5) ties
    tiny = torch.randn(128, 256, generator=g) * 1e-3
    tiny[:, :128] *= 1e-4                                             # subnormal fp8 results
    big = torch.randn(256, 384, generator=g) * 3e3
    return [t.to(device=device, dtype=dtype) for t in (ragged, ties, tiny, big)]


_AGREES: dict[tuple, bool] = {}


def agrees_with(kind: str, reference, device, dtype) -> bool:
    """Whether the fused ``kind`` quantizer gives ``reference``'s exact result on the probe
    weights (asked once per quantizer, device and dtype; False where the kernels cannot
    run, or where ``reference`` raises, a learner's unwritten stub included)."""
    key = (kind, reference, str(device), dtype)
    if key not in _AGREES:
        ok = triton is not None and torch.device(device).type == "cuda"
        try:
            for w in probe_weights(device, dtype) if ok else ():
                q1, s1 = reference(w)
                q2, s2 = FUSED[kind](w)
                if not (torch.equal(s1, s2) and torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))):
                    ok = False
                    break
        except Exception:  # noqa: BLE001 - a reference that cannot run keeps its own path (and fails there)
            ok = False
        _AGREES[key] = ok
    return _AGREES[key]
