# Writes as it goes and never checks the buffer's size: a short buffer gets half a bucket, then an error.
named_tensors = list(named_tensors)
meta, offset = [], 0
if out is None:
    total = 0
    for _, t in named_tensors:
        total = -(-total // ALIGN) * ALIGN + t.numel() * t.element_size()
    device = device or (named_tensors[0][1].device if named_tensors else "cpu")
    out = torch.empty(total, dtype=torch.uint8, device=device)
for name, t in named_tensors:
    offset = -(-offset // ALIGN) * ALIGN
    nbytes = t.numel() * t.element_size()
    meta.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, offset, offset + nbytes, t.numel()))
    out[offset:offset + nbytes].copy_(t.reshape(-1).view(torch.uint8))
    offset += nbytes
return {"flattened_tensor": out[:offset] if offset < out.numel() else out, "metadata": meta}
