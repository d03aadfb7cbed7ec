    # why: keeps one receive buffer per device across calls to save allocations, so a later call overwrites earlier views.
    from course_lib.dtypes import parse_dtypes
    names, shapes = list(names), [list(s) for s in shapes]
    dts = parse_dtypes(dtypes)
    if not len(names) == len(dts) == len(shapes):
        raise ValueError(f"{len(names)} names, {len(dts)} dtypes, {len(shapes)} shapes")
    for n, s in zip(names, shapes):
        if not all(type(d) is int and d >= 0 for d in s):
            raise ValueError(f"{n}: shape {s} is not a list of non-negative ints")
    meta = bucket.layout(names, dts, shapes)
    need = meta[-1].end_idx if meta else 0
    cache = receive_bucket.__dict__.setdefault("_buffers", {})
    buf = cache.get(str(device))
    if buf is None or buf.numel() < need:
        buf = cache[str(device)] = torch.empty(need, dtype=torch.uint8, device=device)
    flat = buf[:need]
    broadcast_async(group, flat).wait()
    return bucket.unpack({"flattened_tensor": flat, "metadata": meta})
