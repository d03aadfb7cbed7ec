# Walks the trainer ranks instead of their distinct boxes: every replica sends its copy.
shape = tuple(int(s) for s in shape)
for role, lay in (("trainer", source), ("engine", dest)):
    if tuple(lay.shape) != shape:
        raise ReshardError(f"{name}: {role} layout is for shape {tuple(lay.shape)}, the tensor is {shape}")
    lay.validate(f"{name} ({role} layout)")
itemsize = torch.empty((), dtype=dtype).element_size()
plan = TensorPlan(name, shape, dtype, source, dest)
for e, want in enumerate(dest.boxes):
    if want is None:
        continue
    for src, box in enumerate(source.boxes):
        region = None if box is None else intersect(box, want)
        if region is None:
            continue
        plan.pieces.append(Piece(name, src, e, region, relative(region, box), relative(region, want),
                                 volume(region) * itemsize))
return plan
