# matched_fraction divides by the length of the answer given, not the one expected.
if len(expected) != len(got):
    raise ValueError(f"{len(expected)} expected outputs but {len(got)} outputs to check")
if not expected:
    raise ValueError("nothing to compare: the request set is empty")
firsts = [first_divergence(e, g) for e, g in zip(expected, got)]
# An identical answer reproduced all of the expected one, however long (or empty) it is.
matched = [1.0 if f is None else f / len(g) if g else 0.0 for f, g in zip(firsts, got)]
return {"first_divergence": firsts, "agreement": sum(f is None for f in firsts) / len(firsts),
        "matched_fraction": sum(matched) / len(matched)}
