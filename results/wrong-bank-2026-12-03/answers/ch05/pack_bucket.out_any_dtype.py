    # why: checks only that out is long enough (in bytes), accepting a buffer that is not 1-D uint8 by viewing it as bytes.
    named_tensors = list(named_tensors)
    metadata, end = [], 0
    for name, t in named_tensors:
        start = align_up(end)
        nbytes = t.numel() * t.element_size()
        metadata.append(FlattenedTensorMetadata(name, torch.Size(t.shape), t.dtype, start, start + nbytes, t.numel()))
        end = start + nbytes
    total = end
    if out is not None:
        out = out.reshape(-1).view(torch.uint8)
        if out.numel() < total:
            raise BucketError(f"out buffer holds {out.numel()} bytes, {total} needed")
        flat = out if out.numel() == total else out[:total]
    else:
        dev = device if device is not None else (named_tensors[0][1].device if named_tensors else "cpu")
        flat = torch.empty(total, dtype=torch.uint8, device=dev)
    for m, (_, t) in zip(metadata, named_tensors):
        if m.numel:
            flat[m.start_idx:m.end_idx].view(t.dtype).view(t.shape).copy_(t)
    return {"flattened_tensor": flat, "metadata": metadata}
