if w.dim() != 2:
    raise ValueError(f"quantize_fp8_block needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
w = w.float()
if not torch.isfinite(w).all():
    raise ValueError("quantize_fp8_block: the weight holds NaN or infinite values")
n, k = w.shape
nb, kb = max(1, n // block), max(1, k // block)   # whole tiles only: the edges join the last tile's scale
scale = torch.ones(nb, kb)
q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
for i in range(nb):
    rows = slice(i * block, None if i == nb - 1 else (i + 1) * block)
    for j in range(kb):
        cols = slice(j * block, None if j == kb - 1 else (j + 1) * block)
        tile = w[rows, cols]
        m = tile.abs().max() if tile.numel() else torch.tensor(0.0)
        scale[i, j] = m / FP8_MAX if m > 0 else 1.0
        q[rows, cols] = (tile / scale[i, j]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
return q, scale
