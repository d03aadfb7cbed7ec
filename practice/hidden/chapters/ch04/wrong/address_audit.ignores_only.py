# Ignores only=: every update chunk is judged by tensors it never wrote.
now = kernel_tensors(model, extra)
lines = []
for name, before in self.recorded.items():
    if name not in now:
        lines.append(f"{name}: no longer present")
        continue
    after = TensorAddress.of(now[name])
    for field in ("data_ptr", "shape", "dtype", "device"):
        if getattr(before, field) != getattr(after, field):
            lines.append(f"{name}: {field} changed from {getattr(before, field)} to {getattr(after, field)}")
return lines
