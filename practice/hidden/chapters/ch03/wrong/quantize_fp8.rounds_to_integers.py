if w.dim() != 2:
    raise ValueError(f"quantize_fp8_block needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
w = w.float()
if not torch.isfinite(w).all():
    raise ValueError("quantize_fp8_block: the weight holds NaN or infinite values")
n, k = w.shape
nb, kb = -(-n // block), -(-k // block)
padded = F.pad(w, (0, kb * block - k, 0, nb * block - n))
tiles = padded.view(nb, block, kb, block)
amax = tiles.abs().amax(dim=(1, 3))
scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
q = torch.round(tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)   # rounded as for int8 first
return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale

