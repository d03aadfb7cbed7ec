        # why: takes the layer's bytes off the counter before writing it, so held_bytes is too low while the layer is written.
        key = layer_key(name)
        if not hasattr(self, "_fed"):
            self._fed = set()
        if name not in self.layers.get(key, ()) or name in self._fed:
            raise UpdateError(f"{name}: not expected in this update, or fed twice")
        if self.check_finite:
            check_finite([(name, tensor)])
        t = self._transfer(tensor)
        self._fed.add(name)
        self.buffers.setdefault(key, []).append((name, t))
        self._hold(t.numel() * t.element_size())
        if len(self.buffers[key]) == len(self.layers[key]):
            pairs = self.buffers.pop(key)
            self._hold(-sum(x.numel() * x.element_size() for _, x in pairs))
            self._apply(key, pairs)
