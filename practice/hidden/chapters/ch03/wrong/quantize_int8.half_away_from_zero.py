if w.dim() != 2:
    raise ValueError(f"quantize_int8_per_channel needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
w = w.float()
if not torch.isfinite(w).all():
    raise ValueError("quantize_int8_per_channel: the weight holds NaN or infinite values")
amax = w.abs().amax(dim=1)
scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
x = w / scale[:, None]
q = (torch.sign(x) * torch.floor(x.abs() + 0.5)).clamp_(-127, 127).to(torch.int8)
return q, scale
