        # why: detects a repeated name only among the tensors still held, so a name of an already written layer is written again.
        key = layer_key(name)
        if name not in self.layers.get(key, ()) or name in (n for n, _ in self.buffers.get(key, [])):
            raise UpdateError(f"{name}: not expected in this update, or fed twice")
        if self.check_finite:
            check_finite([(name, tensor)])
        t = self._transfer(tensor)
        self.buffers.setdefault(key, []).append((name, t))
        self._hold(t.numel() * t.element_size())
        if len(self.buffers[key]) == len(self.layers[key]):
            pairs = self.buffers.pop(key)
            self._apply(key, pairs)
            self._hold(-sum(x.numel() * x.element_size() for _, x in pairs))
