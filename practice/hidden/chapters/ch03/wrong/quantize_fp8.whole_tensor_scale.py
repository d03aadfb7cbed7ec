if w.dim() != 2:
    raise ValueError(f"quantize_fp8_block needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
w = w.float()
if not torch.isfinite(w).all():
    raise ValueError("quantize_fp8_block: the weight holds NaN or infinite values")
n, k = w.shape
nb, kb = -(-n // block), -(-k // block)
amax = w.abs().max() if w.numel() else torch.tensor(0.0)
s = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
scale = torch.full((nb, kb), float(s))
q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
return q.contiguous(), scale
