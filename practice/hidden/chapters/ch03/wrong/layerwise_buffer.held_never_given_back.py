key = layer_key(name)
if name not in self.remaining.get(key, ()):
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
tensor = self._transfer(tensor)
self.buffers.setdefault(key, []).append((name, tensor))
self._hold(tensor.numel() * tensor.element_size())
self.remaining[key].discard(name)
if not self.remaining[key]:
    self._apply(key, self.buffers.pop(key))  # released, but the count of held bytes only grows
