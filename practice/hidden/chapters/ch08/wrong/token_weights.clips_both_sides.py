# Truncates at both ends, [1/clip, clip]: a stale token the new policy likes less is pushed up.
if not clip > 0:
    raise ValueError(f"clip must be a number > 0, got {clip!r}")
weights = torch.ones(logp_now.shape[0], dtype=torch.float32)
expected = 0
for span in spans:
    version, start, end = span["version"], span["start"], span["end"]
    if start != expected or end <= start:
        raise ValueError(f"span {span} does not start at token {expected}")
    expected = end
    if version == current:
        continue
    if version not in logp_by_version:
        weights[start:end] = 0.0
        continue
    ratio = torch.exp(logp_now[start:end].float() - logp_by_version[version][start:end].float())
    weights[start:end] = torch.nan_to_num(ratio, nan=0.0).clamp(min=1 / clip, max=clip)
if expected != logp_now.shape[0]:
    raise ValueError(f"the spans cover {expected} tokens but the rollout has {logp_now.shape[0]} log-probs")
return weights
