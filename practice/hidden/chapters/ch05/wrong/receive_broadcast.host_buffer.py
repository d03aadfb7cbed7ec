# Receives into a host buffer whatever device was asked for (the broadcast "goes through
# the host anyway"): the views are on the CPU, not on the engine's device.
if not (len(names) == len(dtypes) == len(shapes)):
    raise ValueError("names, dtypes and shapes must have the same length")
parsed = []
for name, d, shape in zip(names, dtypes, shapes):
    if isinstance(d, str):
        d = getattr(torch, d.removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"{name}: dtype {d!r} is not a torch dtype")
    if not all(type(s) is int and s >= 0 for s in shape):
        raise ValueError(f"{name}: shape {shape!r} is not a list of non-negative integers")
    parsed.append(d)
meta = bucket.layout(names, parsed, shapes)
flat = torch.empty(meta[-1].end_idx if meta else 0, dtype=torch.uint8)
broadcast_async(group, flat).wait()
return bucket.unpack({"flattened_tensor": flat, "metadata": meta})
