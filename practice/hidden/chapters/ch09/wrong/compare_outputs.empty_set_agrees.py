# An empty request set agrees fully instead of being refused.
if len(expected) != len(got):
    raise ValueError(f"{len(expected)} expected outputs but {len(got)} outputs to check")
if not expected:
    return {"first_divergence": [], "agreement": 1.0, "matched_fraction": 1.0}
firsts = [first_divergence(e, g) for e, g in zip(expected, got)]
# An identical answer reproduced all of the expected one, however long (or empty) it is.
matched = [1.0 if f is None else f / len(e) if e else 0.0 for f, e in zip(firsts, expected)]
return {"first_divergence": firsts, "agreement": sum(f is None for f in firsts) / len(firsts),
        "matched_fraction": sum(matched) / len(matched)}
