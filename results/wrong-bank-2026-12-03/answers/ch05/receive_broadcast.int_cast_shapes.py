    # why: converts each size with int(), so a float size such as 2.5 is truncated instead of refused.
    from course_lib.dtypes import parse_dtypes
    names = list(names)
    dts = parse_dtypes(dtypes)
    shapes = [[int(d) for d in s] for s in shapes]
    if not len(names) == len(dts) == len(shapes):
        raise ValueError(f"{len(names)} names, {len(dts)} dtypes, {len(shapes)} shapes")
    for n, s in zip(names, shapes):
        if any(d < 0 for d in s):
            raise ValueError(f"{n}: shape {s} has a negative size")
    meta = bucket.layout(names, dts, shapes)
    buf = torch.empty(meta[-1].end_idx if meta else 0, dtype=torch.uint8, device=device)
    broadcast_async(group, buf).wait()
    return bucket.unpack({"flattened_tensor": buf, "metadata": meta})
