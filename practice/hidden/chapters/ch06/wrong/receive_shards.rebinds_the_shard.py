# Receives into a buffer and then points the shard's name at it: the other pieces of that
# shard are lost, and the shard has the piece's shape.
trainer_ranks = _group_ranks(plan, trainer_group_ranks, engine_group_ranks)[0]
shards = _empty_shards(plan, engine_rank, torch.device(device))
tags, window = _tags(plan), _Window(inflight_bytes)
for p in plan.pieces_for(engine_rank):
    view = shards[p.name][box_slices(p.dst_box)]
    buf = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    window.add(group.recv([buf], trainer_ranks[p.src], tags[id(p)]), p.nbytes,
               done=lambda name=p.name, buf=buf: shards.__setitem__(name, buf))
window.drain()
return shards
