key = layer_key(name)
tensor = self._transfer(tensor)
self.buffers.setdefault(key, []).append((name, tensor))
self._hold(tensor.numel() * tensor.element_size())
self.remaining.setdefault(key, set()).discard(name)
if not self.remaining[key]:
    tensors = self.buffers.pop(key)
    self._apply(key, tensors)
    self._hold(-sum(t.numel() * t.element_size() for _, t in tensors))
