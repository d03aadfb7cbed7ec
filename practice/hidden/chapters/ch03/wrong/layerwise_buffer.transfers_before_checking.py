# Moves the tensor to the engine's device first and checks its name afterwards: a refused
# name has already been transferred (device memory and transfer time spent on it).
tensor = self._transfer(tensor)
key = layer_key(name)
if name not in self.remaining.get(key, ()):
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
self.buffers.setdefault(key, []).append((name, tensor))
self._hold(tensor.numel() * tensor.element_size())
self.remaining[key].discard(name)
if not self.remaining[key]:
    tensors = self.buffers.pop(key)
    self._apply(key, tensors)
    self._hold(-sum(t.numel() * t.element_size() for _, t in tensors))
