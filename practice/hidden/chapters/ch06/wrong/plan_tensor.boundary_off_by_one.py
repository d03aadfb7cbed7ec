# Treats boxes that only touch at a shard boundary as meeting: empty pieces at every cut.
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
for e, want in enumerate(dest.boxes):
    if want is None:
        continue
    for box, ranks in holders.items():
        region = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, want))
        if any(a > b for a, b in region):
            continue
        src = ranks[e % len(ranks)]
        plan.pieces.append(Piece(name, src, e, region, relative(region, box), relative(region, want),
                                 volume(region) * itemsize))
return plan
