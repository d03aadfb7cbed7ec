# Walks the trainer's boxes first, then the engine ranks each meets: the right pieces, in
# another order than the contract's (engine ranks ascending, then source boxes).
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
for box, ranks in holders.items():
    for e, want in enumerate(dest.boxes):
        if want is None:
            continue
        region = intersect(box, want)
        if region is None:
            continue
        plan.pieces.append(Piece(name, ranks[e % len(ranks)], e, region, relative(region, box),
                                 relative(region, want), volume(region) * itemsize))
return plan
