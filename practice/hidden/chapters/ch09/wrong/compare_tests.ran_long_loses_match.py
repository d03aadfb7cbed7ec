# Expects an answer that ran on to lose matched share (2 of its 4 tokens): the reference fails the test.
def call(expected, got):
    """The comparison on fresh copies of the answers; the inputs must be left as they were."""
    kept = copy.deepcopy((expected, got))
    result = compare(expected, got)
    assert (expected, got) == kept, f"compare changed its inputs: {kept} is now {(expected, got)}"
    return result

def check_share(value, want, name, case):
    assert isinstance(value, float), f"{case}: {name} should be a float, got {value!r}"
    assert math.isclose(value, want, abs_tol=1e-12), f"{case}: {name} should be {want}, got {value}"

# One request per situation: (expected, got, first divergence, share of expected reproduced).
situations = [
    ([4, 5, 6, 7], [4, 5, 0, 7], 2, 0.5),     # a token differs; equal lengths; the tail matches again
    ([4, 5, 6], [0, 5, 6], 0, 0.0),           # the first token differs
    ([4, 5, 6, 7], [4, 5, 6], 3, 0.75),       # cut short
    ([4, 5], [4, 5, 6, 7], 2, 0.5),           # ran on: 2 of its 4 tokens match
    ([4, 5, 6], [], 0, 0.0),                  # empty answer where tokens were expected
    ([], [4, 5], 0, 0.0),                     # tokens where none were expected
    ([], [], None, 1.0),                      # both empty
    ([4, 5, 6], [4, 5, 6], None, 1.0),        # identical
]
for expected, got, first, reproduced in situations:
    case = f"{expected} vs {got}"
    result = call([list(expected)], [list(got)])
    assert result["first_divergence"] == [first], f"{case}: first_divergence should be [{first}]"
    assert all(f is None or type(f) is int for f in result["first_divergence"]), f"{case}: positions are plain ints"
    check_share(result["agreement"], 1.0 if first is None else 0.0, "agreement", case)
    check_share(result["matched_fraction"], reproduced, "matched_fraction", case)

result = call([list(s[0]) for s in situations], [list(s[1]) for s in situations])
assert result["first_divergence"] == [s[2] for s in situations], "one first divergence per request, in order"
check_share(result["agreement"], 2 / len(situations), "agreement", "the whole set")
check_share(result["matched_fraction"], sum(s[3] for s in situations) / len(situations), "matched_fraction",
            "the whole set")

for expected, got in [([[1], [2]], [[1], [2], [3]]), ([[1], [2], [3], [4]], [[1]])]:
    try:
        call(expected, got)
    except ValueError as error:
        for n in (len(expected), len(got)):
            assert str(n) in str(error), f"the ValueError for {len(expected)} vs {len(got)} answers must say {n}"
    else:
        raise AssertionError(f"{len(expected)} expected answers and {len(got)} given must raise ValueError")
try:
    call([], [])
except ValueError:
    pass
else:
    raise AssertionError("an empty request set must raise ValueError")
