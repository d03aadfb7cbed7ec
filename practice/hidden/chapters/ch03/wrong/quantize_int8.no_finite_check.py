if w.dim() != 2:
    raise ValueError(f"quantize_int8_per_channel needs a 2-D weight [out, in], got shape {tuple(w.shape)}")
w = w.float()
amax = w.abs().amax(dim=1)
scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
return q, scale
