key = layer_key(name)
held = self.buffers.get(key, [])
tensor = self._transfer(tensor)
held.append((name, tensor))
self.buffers[key] = held
self._hold(tensor.numel() * tensor.element_size())
if len(self.buffers[key]) >= len(self.layers.get(key, ())):
    pairs = self.buffers.pop(key)
    if self.check_finite:
        check_finite(pairs)
    self._apply(key, pairs)
    self._hold(-sum(t.numel() * t.element_size() for _, t in pairs))
