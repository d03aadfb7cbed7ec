    # why: returns [] for an empty bucket without joining the broadcast, so the sender's collective is left waiting.
    from course_lib.dtypes import parse_dtypes
    names, shapes = list(names), [list(s) for s in shapes]
    dts = parse_dtypes(dtypes)
    if not len(names) == len(dts) == len(shapes):
        raise ValueError(f"{len(names)} names, {len(dts)} dtypes, {len(shapes)} shapes")
    for n, s in zip(names, shapes):
        if not all(type(d) is int and d >= 0 for d in s):
            raise ValueError(f"{n}: shape {s} is not a list of non-negative ints")
    if not names:
        return []
    meta = bucket.layout(names, dts, shapes)
    buf = torch.empty(meta[-1].end_idx, dtype=torch.uint8, device=device)
    broadcast_async(group, buf).wait()
    return bucket.unpack({"flattened_tensor": buf, "metadata": meta})
