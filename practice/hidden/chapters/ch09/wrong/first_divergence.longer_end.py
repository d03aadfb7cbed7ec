# An answer cut short diverges where the longer one ends.
for i, (a, b) in enumerate(zip(expected, got)):
    if a != b:
        return i
# zip stops at the shorter list: equal so far, so only the lengths can still differ
return None if len(expected) == len(got) else max(len(expected), len(got))
