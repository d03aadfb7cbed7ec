key = layer_key(name)
held = self.buffers.get(key, [])
if name not in self.layers.get(key, ()) or name in (n for n, _ in held):   # a written layer's name is taken again
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
tensor = self._transfer(tensor)
held.append((name, tensor))
self.buffers[key] = held
self._hold(tensor.numel() * tensor.element_size())
if len(self.buffers[key]) == len(self.layers[key]):
    pairs = self.buffers.pop(key)
    if self.check_finite:
        check_finite(pairs)
    self._apply(key, pairs)
    self._hold(-sum(t.numel() * t.element_size() for _, t in pairs))
