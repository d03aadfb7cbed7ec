    # why: rounds the whole buffer up to the alignment, so a new bucket is longer than the last tensor's end_idx.
    named_tensors = list(named_tensors)
    metadata, end = [], 0
    for name, t in named_tensors:
        start = align_up(end)
        nbytes = t.numel() * t.element_size()
        metadata.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, start, start + nbytes, t.numel()))
        end = start + nbytes
    total = align_up(end)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.dtype != torch.uint8 or out.numel() < total:
            raise BucketError(f"out buffer of {getattr(out, 'shape', None)} cannot hold {total} bytes")
        flat = out if out.numel() == total else out[:total]
    else:
        dev = device if device is not None else (named_tensors[0][1].device if named_tensors else "cpu")
        flat = torch.empty(total, dtype=torch.uint8, device=dev)
    for m, (_, t) in zip(metadata, named_tensors):
        if m.numel:
            flat[m.start_idx:m.end_idx].view(t.dtype).view(t.shape).copy_(t)
    return {"flattened_tensor": flat, "metadata": metadata}
