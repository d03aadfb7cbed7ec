# Compares the integer addresses alone: a view with the same first byte and another shape or dtype passes.
if only is None:
    now = kernel_tensors(model, extra)
else:
    params = model._params() if hasattr(model, "_params") else dict(model.named_parameters())
    now = {name: params[name] for name in only if name in params}
lines = []
for name, before in self.recorded.items():
    if only is not None and name not in only:
        continue
    if name not in now:
        lines.append(f"{name}: no longer present")
    elif now[name].data_ptr() != before.data_ptr:
        lines.append(f"{name}: data_ptr changed from {hex(before.data_ptr)} to {hex(now[name].data_ptr())}")
return lines
