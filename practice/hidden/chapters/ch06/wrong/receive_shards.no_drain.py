# Forgets to wait for the receives still in flight: their bytes (and the copies of column
# pieces) never arrive before the shards are returned.
trainer_ranks = _group_ranks(plan, trainer_group_ranks, engine_group_ranks)[0]
shards = _empty_shards(plan, engine_rank, torch.device(device))
tags, window = _tags(plan), _Window(inflight_bytes)
for p in plan.pieces_for(engine_rank):
    view = shards[p.name][box_slices(p.dst_box)]
    if view.is_contiguous():
        window.add(group.recv([view], trainer_ranks[p.src], tags[id(p)]), p.nbytes)
    else:
        buf = torch.empty(view.shape, dtype=view.dtype, device=view.device)
        window.add(group.recv([buf], trainer_ranks[p.src], tags[id(p)]), p.nbytes,
                   done=lambda view=view, buf=buf: view.copy_(buf))
return shards
