key = layer_key(name)
held = self.buffers.get(key, [])
if name not in self.layers.get(key, ()) or key in self.applied or name in (n for n, _ in held):
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
tensor = self._transfer(tensor)
held.append((name, tensor))
self.buffers[key] = held
self._hold(tensor.numel() * tensor.element_size())
if True:   # each tensor written as it arrives
    self.buffers.pop(key)
    if self.check_finite:
        check_finite([(name, tensor)])
    self._apply(key, [(name, tensor)])
    self._hold(-tensor.numel() * tensor.element_size())
