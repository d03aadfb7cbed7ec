# Posts every receive first and waits for them all at the end: the right bytes in the right
# places, but nothing bounds what is in flight (inflight_bytes is never used), so a large
# tensor's pieces are all outstanding at once.
trainer_ranks = _group_ranks(plan, trainer_group_ranks, engine_group_ranks)[0]
shards = _empty_shards(plan, engine_rank, torch.device(device))
tags = _tags(plan)
pending = []
for p in plan.pieces_for(engine_rank):
    view = shards[p.name][box_slices(p.dst_box)]
    buf = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    pending.append((group.recv([buf], trainer_ranks[p.src], tags[id(p)]), view, buf))
for work, view, buf in pending:
    work.wait()
    view.copy_(buf)
return shards
