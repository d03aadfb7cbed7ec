    # why: uses one ratio per span (the product over its tokens) instead of a ratio per token.
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
        raise ValueError(f"clip must be a number > 0, got {clip!r}")
    T, pos = len(logp_now), 0
    for s in spans:
        if s["start"] != pos or s["end"] <= s["start"]:
            raise ValueError(f"span {s} does not start at token {pos} or is empty")
        pos = s["end"]
    if pos != T:
        raise ValueError(f"spans cover {pos} tokens, logp_now has {T}")
    w = torch.zeros(T, dtype=torch.float32)
    for s in spans:
        v, a, b = s["version"], s["start"], s["end"]
        if v == current:
            w[a:b] = 1.0
        elif v in logp_by_version:
            r = torch.exp((logp_now[a:b].float() - logp_by_version[v][a:b].float()).sum())
            r = torch.nan_to_num(r, nan=0.0, posinf=clip)
            w[a:b] = torch.clamp(r, max=clip)
    return w
