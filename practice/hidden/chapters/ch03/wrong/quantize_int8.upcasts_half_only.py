# Upcasts only the 16-bit float types, so a float64 weight is quantized in float64: its
# scales come back as float64 (and its integers may round differently), not float32.
if w.dim() != 2:
    raise ValueError(f"need a 2-D weight, got shape {tuple(w.shape)}")
if w.dtype in (torch.float16, torch.bfloat16):
    w = w.float()
if not torch.isfinite(w).all():
    raise ValueError("the weight holds NaN or infinite values")
amax = w.abs().amax(dim=1)
scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
return q, scale
