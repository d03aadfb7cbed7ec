if not clip > 0:
    raise ValueError(f"clip must be a number > 0, got {clip!r}")
weights = torch.ones(len(logp_now), dtype=torch.float32)
covered = 0
for span in spans:
    v, start, end = span["version"], span["start"], span["end"]
    if start != covered or end <= start:
        raise ValueError(f"span {span} leaves a gap, overlaps or is empty")
    covered = end
    if v == current:
        continue
    if v not in logp_by_version:
        weights[start:end] = 0.0
        continue
    ratio = torch.exp(logp_now[start:end] - logp_by_version[v][start:end])
    ratio = torch.nan_to_num(ratio, nan=0.0)
    weights[start:end] = torch.clamp(ratio, max=clip).float()
if covered != len(logp_now):
    raise ValueError(f"the spans cover {covered} tokens, the rollout has {len(logp_now)}")
return weights
