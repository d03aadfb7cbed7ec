    # why: pads to whole tiles and returns a slice of the padded result, which is not contiguous.
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(w.shape)}")
    w32 = w.float()
    if not torch.isfinite(w32).all():
        raise ValueError("weight holds NaN or infinite values")
    out, inn = w32.shape
    nbo, nbi = -(-out // block), -(-inn // block)
    padded = F.pad(w32, (0, nbi * block - inn, 0, nbo * block - out))
    tiles = padded.view(nbo, block, nbi, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nbo * block, nbi * block)[:out, :inn], scale
