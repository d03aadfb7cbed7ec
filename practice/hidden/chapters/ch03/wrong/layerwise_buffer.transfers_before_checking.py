# Moves the tensor to the engine's device first and checks its name afterwards: a refused
# name has already been transferred (device memory and transfer time spent on it).
tensor = self._transfer(tensor)
key = layer_key(name)
held = self.buffers.get(key, [])
if name not in self.layers.get(key, ()) or key in self.applied or name in (n for n, _ in held):
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
held.append((name, tensor))
self.buffers[key] = held
self._hold(tensor.numel() * tensor.element_size())
if len(self.buffers[key]) == len(self.layers[key]):
    pairs = self.buffers.pop(key)
    if self.check_finite:
        check_finite(pairs)
    self._apply(key, pairs)
    self._hold(-sum(t.numel() * t.element_size() for _, t in pairs))
