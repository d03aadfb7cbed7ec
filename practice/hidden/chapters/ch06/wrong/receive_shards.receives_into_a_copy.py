# Receives each piece into view.contiguous(): for a block of columns that is a fresh copy,
# so the bytes land there and the shard never sees them.
trainer_ranks = _group_ranks(plan, trainer_group_ranks, engine_group_ranks)[0]
shards = _empty_shards(plan, engine_rank, torch.device(device))
tags, window = _tags(plan), _Window(inflight_bytes)
for p in plan.pieces_for(engine_rank):
    view = shards[p.name][box_slices(p.dst_box)]
    window.add(group.recv([view.contiguous()], trainer_ranks[p.src], tags[id(p)]), p.nbytes)
window.drain()
return shards
