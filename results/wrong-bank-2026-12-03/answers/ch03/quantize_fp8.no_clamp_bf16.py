    # why: computes the tile maxima and scales in the weight's own dtype rather than float32.
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("weight holds NaN or infinite values")
    out, inn = w.shape
    nbo, nbi = -(-out // block), -(-inn // block)
    padded = F.pad(w, (0, nbi * block - inn, 0, nbo * block - out))
    tiles = padded.view(nbo, block, nbi, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles.float() / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(nbo * block, nbi * block)[:out, :inn].contiguous().to(torch.float8_e4m3fn)
    return q, scale.float()
