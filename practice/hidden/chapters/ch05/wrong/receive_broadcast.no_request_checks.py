# Trusts the announced dtypes and shapes: a bad request fails deep inside, or not at all.
if not (len(names) == len(dtypes) == len(shapes)):
    raise ValueError("names, dtypes and shapes must have the same length")
parsed = []
for name, d, shape in zip(names, dtypes, shapes):
    if isinstance(d, str):
        d = getattr(torch, d.removeprefix("torch."), None)
    parsed.append(d)
meta = bucket.layout(names, parsed, shapes)
flat = torch.empty(meta[-1].end_idx if meta else 0, dtype=torch.uint8, device=device)
broadcast_async(group, flat).wait()
return bucket.unpack({"flattened_tensor": flat, "metadata": meta})
