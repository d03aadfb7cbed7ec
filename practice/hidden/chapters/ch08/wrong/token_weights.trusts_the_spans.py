# Trusts the spans: a gap, an overlap or a short list goes through and the missing tokens weigh 1.
weights = torch.ones(logp_now.shape[0], dtype=torch.float32)
for span in spans:
    version, start, end = span["version"], span["start"], span["end"]
    if version == current:
        continue
    if version not in logp_by_version:
        weights[start:end] = 0.0
        continue
    ratio = torch.exp(logp_now[start:end].float() - logp_by_version[version][start:end].float())
    weights[start:end] = torch.nan_to_num(ratio, nan=0.0).clamp(max=clip)
return weights
