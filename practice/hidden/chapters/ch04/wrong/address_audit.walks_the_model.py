# Walks the model's own tensors: the KV pool, graph outputs and anything that vanished are never checked.
params = model._params() if hasattr(model, "_params") else dict(model.named_parameters())
now = kernel_tensors(model) if only is None else {n: params[n] for n in only if n in params}
lines = []
for name, t in now.items():
    before = self.recorded.get(name)
    if before is None:
        continue
    after = TensorAddress.of(t)
    for field in ("data_ptr", "shape", "dtype", "device"):
        if getattr(before, field) != getattr(after, field):
            lines.append(f"{name}: {field} changed from {getattr(before, field)} to {getattr(after, field)}")
return lines
