# Sorts the distinct source boxes by where they start in the tensor, not by their first
# holder: the same pieces, in another order when a lower rank holds a later box.
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
    for box in sorted(holders):
        ranks = holders[box]
        region = intersect(box, want)
        if region is None:
            continue
        plan.pieces.append(Piece(name, ranks[e % len(ranks)], e, region, relative(region, box),
                                 relative(region, want), volume(region) * itemsize))
return plan
