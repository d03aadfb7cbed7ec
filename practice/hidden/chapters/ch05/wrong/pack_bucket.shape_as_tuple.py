# Records each shape as a plain tuple, not a torch.Size: equal when compared, but not the
# metadata SGLang's readers expect (no .numel(), another type when pickled).
named_tensors = list(named_tensors)
meta, offset = [], 0
for name, t in named_tensors:
    offset = -(-offset // ALIGN) * ALIGN
    nbytes = t.numel() * t.element_size()
    meta.append(FlattenedTensorMetadata(name, tuple(t.shape), t.dtype, offset, offset + nbytes, t.numel()))
    offset += nbytes
if out is None:
    out = torch.empty(offset, dtype=torch.uint8, device=device or (named_tensors[0][1].device if named_tensors else "cpu"))
elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < offset:
    raise BucketError(f"buffer of {out.numel()} {out.dtype} elements cannot hold {offset} bytes")
for m, (_, t) in zip(meta, named_tensors):
    out[m.start_idx:m.end_idx].view(t.dtype).view(t.shape).copy_(t)
return {"flattened_tensor": out[:offset] if offset < out.numel() else out, "metadata": meta}
