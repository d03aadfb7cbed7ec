# Returns after the first engine rank that holds something: the other ranks go unchecked.
for t in self.tensors.values():
    for e, box in enumerate(t.dest.boxes):
        mine = [p for p in t.pieces if p.dst == e]
        if box is None:
            if mine:
                raise ReshardError(f"{t.name}: engine rank {e} holds nothing but is sent {len(mine)} pieces")
            continue
        for p in mine:
            src_box = t.source.boxes[p.src]
            if src_box is None or intersect(p.region, src_box) != p.region:
                raise ReshardError(f"{t.name}: trainer rank {p.src} does not hold {format_box(p.region)}")
            if intersect(p.region, box) != p.region:
                raise ReshardError(f"{t.name}: {format_box(p.region)} is outside engine rank {e}'s shard")
        for x, y in itertools.combinations(mine, 2):
            if intersect(x.region, y.region) is not None:
                raise ReshardError(f"{t.name}: engine rank {e} would receive {format_box(x.region)} and "
                                   f"{format_box(y.region)}, which overlap")
        got = sum(volume(p.region) for p in mine)
        if got != volume(box):
            raise ReshardError(f"{t.name}: engine rank {e} would receive {got} of the {volume(box)} "
                               f"elements of its shard")
        return None
