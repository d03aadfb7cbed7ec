# An answer cut short (or run long) counts as agreement: only the common part is compared.
shared = min(len(expected), len(got))
for position in range(shared):
    if expected[position] != got[position]:
        return position
return None
