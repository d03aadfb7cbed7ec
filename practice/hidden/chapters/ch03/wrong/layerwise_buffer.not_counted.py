key = layer_key(name)
if name not in self.remaining.get(key, ()):
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
tensor = self._transfer(tensor)
self.buffers.setdefault(key, []).append((name, tensor))
self.remaining[key].discard(name)
if not self.remaining[key]:
    self._apply(key, self.buffers.pop(key))
