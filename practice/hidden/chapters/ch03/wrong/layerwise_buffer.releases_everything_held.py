# Once a layer is written, counts the held bytes back to zero ("one layer at a time, so
# nothing is held now"): tensors of the next layers that arrived early are no longer counted,
# and the peak reported later is too small.
key = layer_key(name)
if name not in self.remaining.get(key, ()):
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
tensor = self._transfer(tensor)
self.buffers.setdefault(key, []).append((name, tensor))
self._hold(tensor.numel() * tensor.element_size())
self.remaining[key].discard(name)
if not self.remaining[key]:
    self._apply(key, self.buffers.pop(key))
    self._hold(-self.held_bytes)
