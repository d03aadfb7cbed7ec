    # why: rounds with floor(x + 0.5), which rounds halves up instead of to even.
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(w.shape)}")
    w32 = w.float()
    if not torch.isfinite(w32).all():
        raise ValueError("weight holds NaN or infinite values")
    amax = w32.abs().amax(dim=1) if w32.numel() else torch.zeros(w32.shape[0])
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.floor(w32 / scale[:, None] + 0.5).clamp(-127, 127).to(torch.int8)
    return q, scale
