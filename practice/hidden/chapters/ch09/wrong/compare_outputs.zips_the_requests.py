# Compares only the requests both lists have: a missing answer goes unnoticed.
if not expected:
    raise ValueError("nothing to compare: the request set is empty")
firsts = [first_divergence(e, g) for e, g in zip(expected, got)]
# An identical answer reproduced all of the expected one, however long (or empty) it is.
matched = [1.0 if f is None else f / len(e) if e else 0.0 for f, e in zip(firsts, expected)]
return {"first_divergence": firsts, "agreement": sum(f is None for f in firsts) / len(firsts),
        "matched_fraction": sum(matched) / len(matched)}
