# Hands the step lists only: a step that reads its input twice passes.
def fresh():
    """Views of every kind the engine hands the step: whole tensors in two dtypes, two
    row ranges of one fused tensor, and a tied name (None)."""
    fused = torch.zeros(6, 4)
    views = {"w": torch.zeros(3, 4), "norm": torch.zeros(5, dtype=torch.bfloat16),
             "q": fused.narrow(0, 0, 2), "k": fused.narrow(0, 2, 4), "lm_head": None}
    return fused, views

def sources(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g, dtype=torch.float64).t(),  # another dtype, not contiguous
            "norm": torch.randn(5, generator=g), "q": torch.randn(2, 4, generator=g),
            "k": torch.randn(4, 4, generator=g), "lm_head": torch.randn(7, 7, generator=g)}

def snapshot(fused, views):
    return fused.clone(), {k: v.clone() for k, v in views.items() if v is not None}

def unchanged(before, fused, views, what):
    assert torch.equal(before[0], fused), f"{what}: the fused tensor was written although the update was refused"
    for k, v in before[1].items():
        assert torch.equal(v, views[k]), f"{what}: {k!r} was written although the update was refused"

# Values land in the views' own memory, converted to each view's dtype, from a generator
# read once, with the tied name skipped; nothing is allocated on the way.
fused, views = fresh()
ptrs = {k: v.data_ptr() for k, v in views.items() if v is not None}
src = sources(0)
plan = plan_for(views)
watch = AllocationWatch()
with watch:
    plan.apply(list(src.items()))
for k, ptr in ptrs.items():
    assert views[k].data_ptr() == ptr, f"{k!r}: the view now points at other memory (rebound, not written)"
    want = src[k].to(views[k].dtype)
    assert torch.equal(views[k], want), f"{k!r}: the view does not hold its tensor's values in its own dtype"
assert torch.equal(fused, torch.cat([src["q"], src["k"]])), "the fused tensor does not hold both views' rows"
smallest = min(src[k].numel() * views[k].element_size() for k in ptrs)
staged = [(op, n) for op, n in watch.new if n >= smallest]
assert not staged, f"the step allocated tensors while copying (staged copies): {staged}"

# Empty and partial updates: only the named views change.
fused, views = fresh()
plan = plan_for(views)
plan.apply([])
assert all(not v.any() for v in views.values() if v is not None), "an empty update wrote something"
plan.apply([("k", src["k"])])
assert torch.equal(views["k"], src["k"]) and not views["q"].any() and not views["w"].any(), \
    "a partial update must write its own views and nothing else"

# Refusals, wherever the bad entry sits: the error the contract names, and nothing written.
bad_shapes = {"broadcastable": torch.ones(1, 4), "same size": torch.ones(4, 3), "flat": torch.ones(12),
              "one more dim": torch.ones(1, 3, 4)}
for label, bad in bad_shapes.items():
    for position in ("first", "last"):
        fused, views = fresh()
        good = [(k, v) for k, v in sources(1).items()]
        pairs = [("w", bad)] + good[1:] if position == "first" else good[1:] + [("w", bad)]
        before = snapshot(fused, views)
        try:
            plan_for(views).apply(iter(pairs))
        except ValueError as e:
            assert "w" in str(e), f"the ValueError for a bad shape must name the tensor: {e}"
        else:
            raise AssertionError(f"a {label} tensor ({tuple(bad.shape)}) for a (3, 4) view, {position}, "
                                 "was not refused with ValueError")
        unchanged(before, fused, views, f"a {label} tensor {position}")
for position in ("first", "last"):
    fused, views = fresh()
    good = list(sources(2).items())
    pairs = [("nope", torch.ones(3, 4))] + good if position == "first" else good + [("nope", torch.ones(3, 4))]
    before = snapshot(fused, views)
    try:
        plan_for(views).apply(iter(pairs))
    except KeyError as e:
        assert "nope" in str(e), f"the KeyError for an unknown name must name it: {e}"
    else:
        raise AssertionError(f"an unknown name ({position}) was not refused with KeyError")
    unchanged(before, fused, views, f"an unknown name {position}")
