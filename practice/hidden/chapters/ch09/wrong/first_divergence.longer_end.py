# An answer cut short diverges where the longer one ends.
shared = min(len(expected), len(got))
for position in range(shared):
    if expected[position] != got[position]:
        return position
return None if len(expected) == len(got) else max(len(expected), len(got))
