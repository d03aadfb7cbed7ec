# Adds up the pieces of all engine ranks against all their shards: one rank's gap hides
# behind another rank's extra piece, and a piece outside its shard is never looked at.
for t in self.tensors.values():
    got = sum(volume(p.region) for p in t.pieces)
    want = sum(volume(b) for b in t.dest.boxes if b is not None)
    if got != want:
        raise ReshardError(f"{t.name}: the plan moves {got} elements, the engine ranks hold {want}")
    for x, y in itertools.combinations(t.pieces, 2):
        if x.dst == y.dst and intersect(x.region, y.region) is not None:
            raise ReshardError(f"{t.name}: engine rank {x.dst} would receive {format_box(x.region)} and "
                               f"{format_box(y.region)}, which overlap")
