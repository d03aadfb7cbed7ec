# Once a layer is written, counts the held bytes back to zero ("one layer at a time, so
# nothing is held now"): tensors of the next layers that arrived early are no longer counted,
# and the peak reported later is too small.
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
    self._apply(key, pairs)
    self._hold(-self.held_bytes)
