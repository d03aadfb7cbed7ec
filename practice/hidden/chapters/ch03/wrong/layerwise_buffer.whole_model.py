key = layer_key(name)
if name not in self.remaining.get(key, ()):
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
tensor = self._transfer(tensor)
self.buffers.setdefault(key, []).append((name, tensor))
self._hold(tensor.numel() * tensor.element_size())
self.remaining[key].discard(name)
if not any(self.remaining.values()):   # waits for the whole model
    for k in list(self.buffers):
        tensors = self.buffers.pop(k)
        self._apply(k, tensors)
        self._hold(-sum(t.numel() * t.element_size() for _, t in tensors))
