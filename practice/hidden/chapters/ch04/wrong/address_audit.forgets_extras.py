# Looks for every recorded name among the model's tensors only, leaving out extra: the KV pool is always "gone".
now = kernel_tensors(model)
lines = []
for name, before in self.recorded.items():
    if only is not None and name not in only:
        continue
    if name not in now:
        lines.append(f"{name}: no longer present")
        continue
    after = TensorAddress.of(now[name])
    for field in ("data_ptr", "shape", "dtype", "device"):
        if getattr(before, field) != getattr(after, field):
            lines.append(f"{name}: {field} changed from {getattr(before, field)} to {getattr(after, field)}")
return lines
