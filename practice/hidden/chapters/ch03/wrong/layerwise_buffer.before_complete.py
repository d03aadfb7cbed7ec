key = layer_key(name)
if name not in self.remaining.get(key, ()):
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
tensor = self._transfer(tensor)
self._hold(tensor.numel() * tensor.element_size())
self.remaining[key].discard(name)
self._apply(key, [(name, tensor)])   # each tensor as it arrives
self._hold(-tensor.numel() * tensor.element_size())
