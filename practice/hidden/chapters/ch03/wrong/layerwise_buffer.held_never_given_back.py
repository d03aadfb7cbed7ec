key = layer_key(name)
held = self.buffers.get(key, [])
if name not in self.layers.get(key, ()) or key in self.applied or name in (n for n, _ in held):
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
tensor = self._transfer(tensor)
held.append((name, tensor))
self.buffers[key] = held
self._hold(tensor.numel() * tensor.element_size())
if len(self.buffers[key]) == len(self.layers[key]):
    pairs = self.buffers.pop(key)
    if self.check_finite:
        check_finite(pairs)
    self._apply(key, pairs)   # released, but the count of held bytes only grows
