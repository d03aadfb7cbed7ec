# Uses the trainer's rank as its group rank: right only while trainers come first in the group.
shards = _empty_shards(plan, engine_rank, torch.device(device))
tags, window = _tags(plan), _Window(inflight_bytes)
for p in plan.pieces_for(engine_rank):
    view = shards[p.name][box_slices(p.dst_box)]
    buf = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    window.add(group.recv([buf], p.src, tags[id(p)]), p.nbytes,
               done=lambda view=view, buf=buf: view.copy_(buf))
window.drain()
return shards
