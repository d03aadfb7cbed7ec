# Agreement is the share of matching tokens, not of identical answers.
if len(expected) != len(got):
    raise ValueError(f"{len(expected)} expected outputs but {len(got)} outputs to check")
if not expected:
    raise ValueError("nothing to compare: the request set is empty")
firsts = [first_divergence(e, g) for e, g in zip(expected, got)]
# An identical answer reproduced all of the expected one, however long (or empty) it is.
matched = [1.0 if f is None else f / len(e) if e else 0.0 for f, e in zip(firsts, expected)]
return {"first_divergence": firsts, "agreement": sum(a == b for e, g in zip(expected, got) for a, b in zip(e, g)) / max(1, sum(map(len, expected))),
        "matched_fraction": sum(matched) / len(matched)}
