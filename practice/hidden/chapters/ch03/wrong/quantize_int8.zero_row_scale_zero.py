if w.dim() != 2:
    raise ValueError(f"quantize_int8_per_channel needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
w = w.float()
if not torch.isfinite(w).all():
    raise ValueError("quantize_int8_per_channel: the weight holds NaN or infinite values")
scale = w.abs().amax(dim=1) / 127.0
q = torch.round(w / scale[:, None]).nan_to_num_(0.0).clamp_(-127, 127).to(torch.int8)
return q, scale
