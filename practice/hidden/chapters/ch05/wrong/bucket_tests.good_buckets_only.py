# Checks that good buckets pass and are left as they were, and one overrun; no other bad bucket.
def meta(name, shape, dtype, start, end, numel=None):
    numel = torch.Size(shape).numel() if numel is None else numel
    return FlattenedTensorMetadata(name, shape, dtype, start, end, numel)
# Good buckets at the contract's edges: a slot ending at the end, starts aligned to the dtype only, sizes 0.
f32 = torch.float32
good_bytes = [meta("a", torch.Size([2, 3]), f32, 0, 24), meta("h", [3], torch.float16, 26, 32),
              meta("u", (5,), torch.uint8, 33, 38), meta("z", (0, 4), f32, 40, 40),
              meta("b", (4,), torch.bfloat16, 56, 64)]
good_elems = [meta("x", (2, 2), f32, 0, 4), meta("y", [3], torch.bfloat16, 5, 8),
              meta("w", (2,), torch.int64, 8, 10)]
buckets = {"bytes": (torch.arange(64, dtype=torch.uint8), good_bytes),
           "elements": (torch.arange(10, dtype=torch.float32), good_elems)}

def expect(flat, metadata, what, good=False, name=None):  # good: must pass; else BucketError naming name
    before = flat.clone()
    try:
        validate(flat, metadata)
    except BucketError as e:
        assert not good, f"{what}: refused a good bucket: {e}"
        assert name is None or name in str(e), f"{what}: the BucketError does not name {name!r}: {e}"
    except Exception as e:  # noqa: BLE001 - the contract names the one error
        raise AssertionError(f"{what}: raised {type(e).__name__}, not BucketError: {e}") from None
    else:
        assert good, f"{what}: accepted"
    assert flat.is_meta or torch.equal(flat, before), f"{what}: the validator changed the buffer"
for layout, (flat, entries) in buckets.items():
    expect(flat, entries, f"a good {layout}-layout bucket", good=True)
    expect(flat, tuple(entries), f"a good {layout}-layout bucket as a tuple", good=True)
expect(torch.empty(0, dtype=torch.uint8), [], "an empty bucket", good=True)
expect(torch.arange(10, dtype=torch.float32), [], "an empty metadata list", good=True)
expect(torch.zeros(64, dtype=torch.uint8), [meta("bad", (4,), torch.float32, 56, 72)], "an overrun", name="bad")
