# Never validates the layouts: a trainer layout with a gap or an overlap is planned anyway.
shape = tuple(int(s) for s in shape)
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
        region = intersect(box, want)
        if region is None:
            continue
        src = ranks[e % len(ranks)]
        plan.pieces.append(Piece(name, src, e, region, relative(region, box), relative(region, want),
                                 volume(region) * itemsize))
return plan
