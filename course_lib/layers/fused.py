"""Fused GPU kernels for the forward pass (Triton): fewer, larger kernels per layer.

At batch 1 a decode step reads every weight once (16.4 GB at ~8B: ~3.8 ms at an H200's
copy rate), but written as plain torch ops one layer is about seventy kernels: an RMSNorm
alone is seven (cast, square, mean, add, rsqrt, multiply, cast), rotary fourteen, and
attention over the paged cache gathers every key and value into a new tensor first. Each
kernel costs a few microseconds even inside a CUDA graph, so thousands of them cost more
than the weights. Here each of those groups is one kernel:

- ``rms_norm``: a row's RMSNorm in one pass;
- ``add_rms_norm``: the residual add and the next RMSNorm;
- ``qkv_norm_rope_store``: Qwen3's per-head q/k RMSNorm and the rotary embedding for a
  fused projection's q and k heads at once, writing k and v into the paged cache (the
  layer's whole step between its two projections);
- ``silu_mul``: SwiGLU's ``silu(gate) * up``;
- ``paged_decode_attention``: one query token per sequence against its keys and values,
  read in place through the block table (nothing gathered), online softmax;
- ``paged_prefill_attention``: the same for a prefill's new tokens, causal, every
  sequence of the batch in one launch (prompts of any lengths, cached prefixes included).

The arithmetic rounds where the torch code rounds (a product of two bf16 values is
rounded to bf16, exactly as torch computes it), so results differ from the torch path
only in the order of a reduction's float32 additions (and, in attention, the online
softmax). The CPU path keeps the torch code, which is what the transformers oracle
compares bit for bit; the GPU path is compared within the tolerance its tests state.
A layer uses these only on a CUDA tensor with Triton present, and only where the shapes
fit (``head_dim`` a power of two). ``COURSE_LIB_FUSED_KERNELS=0`` switches them off, to
compare.
"""
from __future__ import annotations

import os

import torch

from course_lib import settings

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve this tensor (CUDA, Triton present, not switched off).
    ``COURSE_LIB_FUSED_KERNELS=interpret`` also runs them on the CPU through Triton's
    interpreter (``TRITON_INTERPRET=1`` set before Triton is imported): slow, for tests."""
    if triton is None:
        return False
    mode = settings.fused_kernels()
    return mode == "interpret" or (mode == "on" and x.is_cuda)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_heads, stride_t, stride_h, n, eps,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0)
        t, h = row // n_heads, row % n_heads
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + t * stride_t + h * stride_h + offs, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        y = (xf * inv).to(x.dtype)  # torch: x.to(float32) * rsqrt(...), back to the input dtype
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n + offs, out, mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0)
        r = tl.load(r_ptr + row * n + offs, mask=mask, other=0.0)
        total = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual add, rounded as torch rounds it
        tl.store(sum_ptr + row * n + offs, total, mask=mask)
        tf = total.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(tf * tf, axis=0) / n + eps)
        y = (tf * inv).to(x.dtype)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + row * n + offs, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _qkv_norm_rope_store_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr,
                                    k_cache_ptr, v_cache_ptr, n_q, n_kv, stride_t, stride_slot, eps,
                                    HALF: tl.constexpr):
        # One program per (token, head): q heads are normed, rotated and written out; k heads
        # normed, rotated and written into the cache at the token's slot, with the v head beside.
        t, hh = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, HALF)
        D: tl.constexpr = 2 * HALF
        base = qkv_ptr + t * stride_t + hh * D
        x1 = tl.load(base + offs)
        x2 = tl.load(base + HALF + offs)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D + eps)
        is_q = hh < n_q
        dt = q_out_ptr.dtype.element_ty
        w1 = tl.where(is_q, tl.load(qw_ptr + offs), tl.load(kw_ptr + offs)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + offs), tl.load(kw_ptr + HALF + offs)).to(tl.float32)
        n1 = (w1 * (f1 * inv).to(x1.dtype).to(tl.float32)).to(dt).to(tl.float32)
        n2 = (w2 * (f2 * inv).to(x1.dtype).to(tl.float32)).to(dt).to(tl.float32)
        pos = tl.load(pos_ptr + t)
        c = tl.load(cos_ptr + pos * D + offs).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + offs).to(dt).to(tl.float32)
        o1 = ((n1 * c).to(dt).to(tl.float32) + (-n2 * s).to(dt).to(tl.float32)).to(dt)
        o2 = ((n2 * c).to(dt).to(tl.float32) + (n1 * s).to(dt).to(tl.float32)).to(dt)
        if is_q:
            dst = q_out_ptr + (t * n_q + hh) * D
            tl.store(dst + offs, o1)
            tl.store(dst + HALF + offs, o2)
        else:
            j = hh - n_q
            at = tl.load(slot_ptr + t) * stride_slot + j * D
            tl.store(k_cache_ptr + at + offs, o1.to(k_cache_ptr.dtype.element_ty))
            tl.store(k_cache_ptr + at + HALF + offs, o2.to(k_cache_ptr.dtype.element_ty))
            v = qkv_ptr + t * stride_t + (n_q + n_kv + j) * D
            tl.store(v_cache_ptr + at + offs, tl.load(v + offs).to(v_cache_ptr.dtype.element_ty))
            tl.store(v_cache_ptr + at + HALF + offs, tl.load(v + HALF + offs).to(v_cache_ptr.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_t, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        g = tl.load(x_ptr + t * stride_t + offs, mask=mask, other=0.0)
        u = tl.load(x_ptr + t * stride_t + inter + offs, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + t * inter + offs, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)

    @triton.jit
    def _attend_paged(q, qpos, k_ptr, v_ptr, table_ptr, ctx, hi, kvh, scale, stride_cb, stride_ct, stride_ch,
                      ROWS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                      IEEE: tl.constexpr):
        """Rows of queries ``q`` [ROWS, D] (row r at position qpos[r]) over one sequence's
        keys and values in the paged cache (``table_ptr``: its block table row, ``ctx``
        tokens, the first ``hi`` read), online softmax; each row sees keys at positions
        <= its own. Returns the attention output [ROWS, D] in float32."""
        d = tl.arange(0, D)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        denom = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        n = tl.arange(0, BLOCK_N)
        for start in range(0, hi, BLOCK_N):
            tok = start + n
            live = tok < ctx
            page = tl.load(table_ptr + tok // PAGE, mask=live, other=0)
            where = page * stride_cb + (tok % PAGE) * stride_ct + kvh * stride_ch
            k = tl.load(k_ptr + where[:, None] + d[None, :], mask=live[:, None], other=0.0)
            v = tl.load(v_ptr + where[:, None] + d[None, :], mask=live[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(live[None, :] & (tok[None, :] <= qpos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = p.to(v.dtype).to(tl.float32)  # rounded to the model's dtype, as the other branch
                acc = acc * alpha[:, None] + tl.dot(pv, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        return acc / denom[:, None]

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, out_ptr, scale,
                             stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb, stride_ob,
                             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        b, kvh = tl.program_id(0), tl.program_id(1)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        gmask = g < GROUP
        q = tl.load(q_ptr + b * stride_qb + (kvh * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
        ctx = tl.load(ctx_ptr + b)
        qpos = tl.zeros([GROUP_PAD], tl.int64) + ctx - 1  # the new token is the last: it sees every key
        out = _attend_paged(q, qpos, k_ptr, v_ptr, tables_ptr + b * stride_tb, ctx, ctx, kvh, scale,
                            stride_cb, stride_ct, stride_ch, GROUP_PAD, D, PAGE, BLOCK_N, IEEE)
        tl.store(out_ptr + b * stride_ob + (kvh * GROUP + g)[:, None] * D + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])

    @triton.jit
    def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, starts_ptr, out_ptr, scale,
                              stride_qt, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb, stride_ot,
                              GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        seq, mblk, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q0 = tl.load(starts_ptr + seq)
        qlen = tl.load(starts_ptr + seq + 1) - q0
        ctx = tl.load(ctx_ptr + seq)
        r = tl.arange(0, BLOCK_M * GROUP)  # rows: (query token, head of this kv head's group)
        i = mblk * BLOCK_M + r // GROUP
        head = kvh * GROUP + r % GROUP
        rmask = i < qlen
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (q0 + i)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=rmask[:, None], other=0.0)
        # Query i sits at position ctx - qlen + i and sees keys at positions <= it. Rows past
        # the prompt are given the last position, so no row sees no key (no 0/0).
        qpos = tl.where(rmask, ctx - qlen + i, ctx - 1)
        hi = tl.minimum(ctx, ctx - qlen + (mblk + 1) * BLOCK_M)  # keys this block's last query sees
        out = _attend_paged(q, qpos, k_ptr, v_ptr, tables_ptr + seq * stride_tb, ctx, hi, kvh, scale,
                            stride_cb, stride_ct, stride_ch, BLOCK_M * GROUP, D, PAGE, BLOCK_N, IEEE)
        tl.store(out_ptr + (q0 + i)[:, None] * stride_ot + head[:, None] * D + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def _use_ieee(dtype: torch.dtype) -> bool:
    # No TF32 where the model asked for float32; Triton's interpreter has no bfloat16 dot.
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` ([T, N] or [T, H, N], the last dimension
    contiguous; rows may be strided, as a slice of a fused projection is), as
    ``layers.norm.RMSNorm`` computes it. Returns a new contiguous tensor."""
    n = x.shape[-1]
    rows3 = x if x.dim() == 3 else x.view(-1, 1, n)
    t, h = rows3.shape[0], rows3.shape[1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if out.numel():
        _rms_norm_kernel[(t * h,)](rows3, weight, out, h, rows3.stride(0), rows3.stride(1), n, eps,
                                   BLOCK=_pow2(n), num_warps=4 if n <= 1024 else 8)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``total = x + residual`` (rounded to their dtype), then RMSNorm of ``total``: returns
    (normed, total), both new [T, N] tensors; what ``norm(x + residual)`` computes, with
    the residual stream kept for the next add."""
    t, n = x.shape
    total = torch.empty_like(x)
    out = torch.empty((t, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if out.numel():
        _add_rms_norm_kernel[(t,)](x.contiguous(), residual.contiguous(), weight, out, total, n, eps,
                                   BLOCK=_pow2(n), num_warps=4 if n <= 1024 else 8)
    return out, total


def qkv_norm_rope_store(qkv: torch.Tensor, n_q: int, n_kv: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                        slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """From a fused projection ``qkv`` [T, (n_q + 2 n_kv) * D] (rows contiguous): q heads
    normed and rotated, returned [T, n_q, D]; k heads normed and rotated and, with the v
    heads, written into the caches ([blocks, page, n_kv, D]) at ``slot_mapping``. What the
    torch layers compute as q/k norm, rotary and ``Attention._store``, in one kernel."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1) and k_cache.stride() == v_cache.stride()
    q = torch.empty((t, n_q, d), dtype=torch.promote_types(qkv.dtype, q_weight.dtype), device=qkv.device)
    if t:
        _qkv_norm_rope_store_kernel[(t, n_q + n_kv)](qkv, q_weight, k_weight, cos, sin, positions, slot_mapping, q,
                                                     k_cache, v_cache, n_q, n_kv, qkv.stride(0), k_cache.stride(1),
                                                     eps, HALF=d // 2, num_warps=1 if d <= 128 else 2)
    return q


def norm_rope_fits(head_dim: int) -> bool:
    return head_dim >= 4 and head_dim & (head_dim - 1) == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [T, 2I] (gate the first half of each row)."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(inter))
    if out.numel():
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), BLOCK=block,
                                                       num_warps=4)
    return out


def decode_fits(group: int, head_dim: int, page: int) -> bool:
    """Whether the attention kernels serve these shapes (powers of two where they tile)."""
    return norm_rope_fits(head_dim) and head_dim >= 16 and page & (page - 1) == 0 and norm_rope_fits(2 * group) \
        and group <= 64


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One new token per sequence: ``q`` [B, Hq, D]; the caches [blocks, page, Hkv, D];
    ``block_tables`` [B, W] (padded; only the first ``ceil(ctx / page)`` entries are
    read); ``context_lens`` [B] (tokens in the cache, this step's included). Returns
    [B, Hq * D]. Reads each sequence's keys and values in place (nothing gathered)."""
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty((b, hq * d), dtype=q.dtype, device=q.device)
    ieee = _use_ieee(q.dtype)
    block_n = max(page, 64 if d <= 128 else 32)
    _paged_decode_kernel[(b, hkv)](q, k_cache, v_cache, block_tables, context_lens, out, scale,
                                   q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                                   k_cache.stride(2), block_tables.stride(0), out.stride(0),
                                   GROUP=group, GROUP_PAD=max(16, _pow2(group)), D=d, PAGE=page,
                                   BLOCK_N=block_n, IEEE=ieee, num_warps=4)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, query_starts: torch.Tensor,
                            max_query_len: int, scale: float) -> torch.Tensor:
    """A prefill's new tokens, causal: ``q`` [T, Hq, D] (the sequences' new tokens one after
    another; sequence ``s``'s are rows ``query_starts[s]:query_starts[s + 1]``), each
    sequence's keys and values already in the cache (``context_lens`` [S] tokens, its
    cached prefix included; the new tokens are its last). Returns [T, Hq * D]."""
    t, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty((t, hq * d), dtype=q.dtype, device=q.device)
    block_m = max(1, 64 // group)
    seqs = context_lens.shape[0]
    if t:
        _paged_prefill_kernel[(seqs, triton.cdiv(max_query_len, block_m), hkv)](
            q, k_cache, v_cache, block_tables, context_lens, query_starts, out, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0),
            GROUP=group, D=d, PAGE=page, BLOCK_M=block_m, BLOCK_N=32 if d <= 128 else 16,
            IEEE=_use_ieee(q.dtype), num_warps=4)
    return out
