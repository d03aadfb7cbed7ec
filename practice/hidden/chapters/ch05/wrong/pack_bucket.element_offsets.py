# Counts offsets in elements, not bytes: ignores each dtype's size.
named_tensors = list(named_tensors)
meta, offset = [], 0
for name, t in named_tensors:
    offset = -(-offset // ALIGN) * ALIGN
    meta.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, offset, offset + t.numel(), t.numel()))
    offset += t.numel()
need = offset
if out is None:
    device = device or (named_tensors[0][1].device if named_tensors else "cpu")
    out = torch.empty(need, dtype=torch.uint8, device=device)
elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < need:
    raise BucketError(f"buffer of {out.numel()} {out.dtype} elements cannot hold {need} bytes")
for m, (_, t) in zip(meta, named_tensors):
    out[m.start_idx:m.end_idx].copy_(t.reshape(-1).view(torch.uint8)[:m.numel])
return {"flattened_tensor": out[:need] if need < out.numel() else out, "metadata": meta}
