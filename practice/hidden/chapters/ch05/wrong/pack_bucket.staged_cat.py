# Builds the whole bucket with one torch.cat (padding included) and copies it into the
# buffer: a second bucket-sized allocation on every call, the buffer reuse wasted.
named_tensors = list(named_tensors)
meta, offset, pieces = [], 0, []
for name, t in named_tensors:
    start = -(-offset // ALIGN) * ALIGN
    nbytes = t.numel() * t.element_size()
    if start > offset:
        pieces.append(torch.zeros(start - offset, dtype=torch.uint8, device=t.device))
    pieces.append(t.reshape(-1).view(torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8, device=t.device))
    meta.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, start, start + nbytes, t.numel()))
    offset = start + nbytes
need = offset
if out is None:
    device = device or (named_tensors[0][1].device if named_tensors else "cpu")
    out = torch.empty(need, dtype=torch.uint8, device=device)
elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < need:
    raise BucketError(f"buffer of {out.numel()} {out.dtype} elements cannot hold {need} bytes")
if pieces:
    out[:need].copy_(torch.cat([p.to(out.device) for p in pieces]))
return {"flattened_tensor": out[:need] if need < out.numel() else out, "metadata": meta}
