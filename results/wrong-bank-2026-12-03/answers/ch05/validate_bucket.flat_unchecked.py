    # why: trusts flat to be a 1-D tensor on a known device and checks only the metadata.
    if not isinstance(metadata, (list, tuple)):
        raise BucketError("metadata must be a list")
    seen = set()
    for m in metadata:
        _check_fields(m)
        if m.name in seen:
            raise BucketError(f"{m.name}: appears twice")
        seen.add(m.name)
        if m.numel != _numel(m.shape):
            raise BucketError(f"{m.name}: numel {m.numel} is not the product of shape {tuple(m.shape)}")
        if not 0 <= m.start_idx <= m.end_idx <= flat.numel():
            raise BucketError(f"{m.name}: [{m.start_idx}, {m.end_idx}) is outside the buffer of {flat.numel()}")
        if flat.dtype == torch.uint8 and m.dtype != torch.uint8:
            size = m.dtype.itemsize
            if m.end_idx - m.start_idx != m.numel * size or m.start_idx % size:
                raise BucketError(f"{m.name}: byte range does not fit {m.numel} x {m.dtype}")
        elif m.end_idx - m.start_idx != m.numel:
            raise BucketError(f"{m.name}: range length is not numel {m.numel}")
