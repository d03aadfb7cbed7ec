    # why: refuses NaN with isnan but lets infinite values through, poisoning the row's scale.
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(w.shape)}")
    w32 = w.float()
    if torch.isnan(w32).any():
        raise ValueError("weight holds NaN values")
    amax = w32.abs().amax(dim=1) if w32.numel() else torch.zeros(w32.shape[0])
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale
