# Any empty answer counts as a divergence at 0, two empty answers included.
if not expected or not got:
    return 0
shared = min(len(expected), len(got))
for position in range(shared):
    if expected[position] != got[position]:
        return position
return None if len(expected) == len(got) else shared
