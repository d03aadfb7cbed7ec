# Looks dtype names up as given: "torch.bfloat16" is refused.
if not (len(names) == len(dtypes) == len(shapes)):
    raise ValueError("names, dtypes and shapes must have the same length")
parsed = []
for name, d, shape in zip(names, dtypes, shapes):
    if isinstance(d, str):
        d = getattr(torch, d, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"{name}: dtype {dtypes[len(parsed)]!r} is not a torch dtype")
    if not all(type(s) is int and s >= 0 for s in shape):
        raise ValueError(f"{name}: shape {shape!r} is not a list of non-negative integers")
    parsed.append(d)
meta = bucket.layout(names, parsed, shapes)
flat = torch.empty(meta[-1].end_idx if meta else 0, dtype=torch.uint8, device=device)
broadcast_async(group, flat).wait()
return bucket.unpack({"flattened_tensor": flat, "metadata": meta})
