# Any empty answer counts as a divergence at 0, two empty answers included.
if not expected or not got:
    return 0
for i, (a, b) in enumerate(zip(expected, got)):
    if a != b:
        return i
# zip stops at the shorter list: equal so far, so only the lengths can still differ
return None if len(expected) == len(got) else min(len(expected), len(got))
