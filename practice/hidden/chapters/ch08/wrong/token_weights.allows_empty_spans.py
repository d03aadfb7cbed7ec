if not clip > 0:
    raise ValueError(f"clip must be a number > 0, got {clip!r}")
weights = torch.ones(logp_now.shape[0], dtype=torch.float32)
covered = 0
for span in spans:
    v, start, end = span["version"], span["start"], span["end"]
    if start != covered or end < start:
        raise ValueError(f"span {span} does not continue where the last one ended")
    covered = end
    if v == current:
        continue
    if v not in logp_by_version:
        weights[start:end] = 0.0
        continue
    ratio = torch.exp(logp_now[start:end].float() - logp_by_version[v][start:end].float())
    weights[start:end] = torch.nan_to_num(ratio, nan=0.0).clamp(max=clip)
if covered != logp_now.shape[0]:
    raise ValueError(f"the spans cover {covered} tokens, the rollout has {logp_now.shape[0]}")
return weights
