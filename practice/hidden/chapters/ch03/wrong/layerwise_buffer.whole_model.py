key = layer_key(name)
held = self.buffers.get(key, [])
if name not in self.layers.get(key, ()) or key in self.applied or name in (n for n, _ in held):
    raise UpdateError(f"{name}: not expected by this update (or sent twice)")
tensor = self._transfer(tensor)
held.append((name, tensor))
self.buffers[key] = held
self._hold(tensor.numel() * tensor.element_size())
if sum(len(v) for v in self.buffers.values()) == sum(len(v) for v in self.layers.values()):   # waits for the whole model
    for k in list(self.buffers):
        pairs = self.buffers.pop(k)
        if self.check_finite:
            check_finite(pairs)
        self._apply(k, pairs)
        self._hold(-sum(t.numel() * t.element_size() for _, t in pairs))
