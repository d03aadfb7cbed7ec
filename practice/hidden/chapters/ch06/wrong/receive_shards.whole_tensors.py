# Allocates every tensor whole and receives each piece at its full-tensor place: right
# values, but each rank builds what it does not own, and the loaders get the wrong shape.
trainer_ranks = _group_ranks(plan, trainer_group_ranks, engine_group_ranks)[0]
shards = {n: torch.zeros(t.shape, dtype=t.dtype, device=torch.device(device)) for n, t in plan.tensors.items()
          if t.dest.boxes[engine_rank] is not None}
tags, window = _tags(plan), _Window(inflight_bytes)
for p in plan.pieces_for(engine_rank):
    view = shards[p.name][box_slices(p.region)]
    buf = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    window.add(group.recv([buf], trainer_ranks[p.src], tags[id(p)]), p.nbytes,
               done=lambda view=view, buf=buf: view.copy_(buf))
window.drain()
return shards
