# Ignores the sender's buffer and allocates a new one for every bucket.
named_tensors = list(named_tensors)
meta, offset = [], 0
for name, t in named_tensors:
    offset = -(-offset // ALIGN) * ALIGN
    nbytes = t.numel() * t.element_size()
    meta.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, offset, offset + nbytes, t.numel()))
    offset += nbytes
if out is not None and (out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < offset):
    raise BucketError(f"buffer of {out.numel()} {out.dtype} elements cannot hold {offset} bytes")
device = device or (out.device if out is not None else named_tensors[0][1].device if named_tensors else "cpu")
flat = torch.empty(offset, dtype=torch.uint8, device=device)
for m, (_, t) in zip(meta, named_tensors):
    flat[m.start_idx:m.end_idx].copy_(t.reshape(-1).view(torch.uint8))
return {"flattened_tensor": flat, "metadata": meta}
