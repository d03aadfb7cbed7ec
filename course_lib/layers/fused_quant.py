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

Each pass is also callable on its own, into tensors the caller gives: the scales pass into
slices of a caller's buffers, the quantizing pass into a row range of a live ``qweight``
(its own row stride). ``direct_quant.py`` uses them to requantize a hot update straight
into the kernel tensors; the kernels' arithmetic is the same, so are the bits.
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
    @triton.jit
    def _fp8_tile_scales(w, scale, bad, n, k, stride_w, kb, BLOCK: tl.constexpr):
        i, j = tl.program_id(0), tl.program_id(1)
        rows = i * BLOCK + tl.arange(0, BLOCK)
        cols = j * BLOCK + tl.arange(0, BLOCK)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        x = tl.load(w + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        # x - x is 0 for every finite x and NaN for NaN and +-inf: count the tile's non-finite values.
        tl.store(bad + i * kb + j, tl.sum(tl.sum(((x - x) != 0).to(tl.int32), axis=1), axis=0))
        tl.store(scale + i * kb + j, tl.where(amax > 0, amax * (1.0 / 448.0), 1.0))

    @triton.jit
    def _fp8_tile_quant(w, q, scale, n, k, stride_w, stride_q, kb, BLOCK: tl.constexpr):
        i, j = tl.program_id(0), tl.program_id(1)
        rows = i * BLOCK + tl.arange(0, BLOCK)
        cols = j * BLOCK + tl.arange(0, BLOCK)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        x = tl.load(w + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(scale + i * kb + j)
        v = tl.minimum(tl.maximum(libdevice.div_rn(x, s), -448.0), 448.0)
        tl.store(q + rows[:, None] * stride_q + cols[None, :], v.to(tl.float8e4nv), mask=mask)

    @triton.jit
    def _int8_row_scales(w, scale, bad, k, stride_w, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        nonfinite = tl.zeros((BLOCK,), dtype=tl.int32)
        for start in range(0, k, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(w + r * stride_w + cols, mask=cols < k, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
            nonfinite += ((x - x) != 0).to(tl.int32)
        m = tl.max(amax, axis=0)
        tl.store(bad + r, tl.sum(nonfinite, axis=0))
        tl.store(scale + r, tl.where(m > 0, m * (1.0 / 127.0), 1.0))

    @triton.jit
    def _int8_row_quant(w, q, scale, k, stride_w, stride_q, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        s = tl.load(scale + r)
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


# ---- the passes, into tensors the caller gives (layers/direct_quant.py writes a layer's live
# rows with them); the quantizers below are the two passes into new tensors ----------------

def fp8_tile_scales(w: torch.Tensor, scale: torch.Tensor, bad: torch.Tensor, block: int = 128) -> None:
    """Pass 1 of FP8-block: each tile's scale into ``scale`` and its count of non-finite
    values into ``bad``, both contiguous [ceil(n/block), ceil(k/block)] (float32, int32;
    slices of larger buffers are fine). No synchronization."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    assert scale.is_contiguous() and bad.is_contiguous() and scale.shape == bad.shape == (nb, kb)
    _fp8_tile_scales[(nb, kb)](w, scale, bad, n, k, w.stride(0), kb, BLOCK=block)


def fp8_tile_quant(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> None:
    """Pass 2 of FP8-block: ``w`` divided by its tiles' ``scale`` into ``q`` [n, k]
    (float8_e4m3fn, rows contiguous, any row stride: a row range of a live ``qweight``)."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    assert q.shape == w.shape and q.stride(1) == 1 and scale.is_contiguous() and scale.shape == (nb, kb)
    _fp8_tile_quant[(nb, kb)](w, q, scale, n, k, w.stride(0), q.stride(0), kb, BLOCK=block)


def int8_row_scales(w: torch.Tensor, scale: torch.Tensor, bad: torch.Tensor) -> None:
    """Pass 1 of int8 per channel: each row's scale into ``scale`` and its count of
    non-finite values into ``bad``, both contiguous [n] (float32, int32). No synchronization."""
    n, k = w.shape
    assert scale.is_contiguous() and bad.is_contiguous() and scale.shape == bad.shape == (n,)
    _int8_row_scales[(n,)](w, scale, bad, k, w.stride(0), BLOCK=1024)


def int8_row_quant(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Pass 2 of int8 per channel: ``w`` over its rows' ``scale``, rounded, into ``q`` [n, k]
    (int8, rows contiguous, any row stride)."""
    n, k = w.shape
    assert q.shape == w.shape and q.stride(1) == 1 and scale.is_contiguous() and scale.shape == (n,)
    _int8_row_quant[(n,)](w, q, scale, k, w.stride(0), q.stride(0), BLOCK=1024)


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_fp8_block``'s result, in two kernel passes (see the module docstring)."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    scale = torch.empty(nb, kb, dtype=torch.float32, device=w.device)
    bad = torch.empty(nb, kb, dtype=torch.int32, device=w.device)
    fp8_tile_scales(w, scale, bad, block)
    _refuse_non_finite(bad, "quantize_fp8_block")
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
    fp8_tile_quant(w, q, scale, block)
    return q, scale


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant.quantize_int8_per_channel``'s result, in two kernel passes."""
    n, k = w.shape
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    bad = torch.empty(n, dtype=torch.int32, device=w.device)
    int8_row_scales(w, scale, bad)
    _refuse_non_finite(bad, "quantize_int8_per_channel")
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    int8_row_quant(w, q, scale)
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
