# Checks only that the caller's buffer is long enough: a float32 (or 2-D) buffer is written
# through copy_, which converts each byte to a float, and handed back as the bucket.
named_tensors = list(named_tensors)
meta, offset = [], 0
for name, t in named_tensors:
    offset = -(-offset // ALIGN) * ALIGN
    nbytes = t.numel() * t.element_size()
    meta.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, offset, offset + nbytes, t.numel()))
    offset += nbytes
need = offset
if out is None:
    device = device or (named_tensors[0][1].device if named_tensors else "cpu")
    out = torch.empty(need, dtype=torch.uint8, device=device)
elif out.numel() < need:
    raise BucketError(f"buffer of {out.numel()} elements cannot hold {need} bytes")
flat = out.reshape(-1)
for m, (_, t) in zip(meta, named_tensors):
    flat[m.start_idx:m.end_idx].copy_(t.reshape(-1).view(torch.uint8))
return {"flattened_tensor": flat[:need] if need < flat.numel() else out, "metadata": meta}
