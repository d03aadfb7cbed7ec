    # why: checks only that the spans add up to T tokens, so a gap followed by an overlap goes unnoticed.
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
        raise ValueError(f"clip must be a number > 0, got {clip!r}")
    T = len(logp_now)
    if sum(s["end"] - s["start"] for s in spans) != T:
        raise ValueError(f"spans do not cover the {T} tokens")
    w = torch.zeros(T, dtype=torch.float32)
    for s in spans:
        v, a, b = s["version"], s["start"], s["end"]
        if v == current:
            w[a:b] = 1.0
        elif v in logp_by_version:
            r = torch.exp(logp_now[a:b].float() - logp_by_version[v][a:b].float())
            w[a:b] = torch.nan_to_num(r, nan=0.0, posinf=clip).clamp(max=clip)
    return w
