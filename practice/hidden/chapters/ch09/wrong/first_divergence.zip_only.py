# An answer cut short (or run long) counts as agreement: only the common part is compared.
for i, (a, b) in enumerate(zip(expected, got)):
    if a != b:
        return i
return None
