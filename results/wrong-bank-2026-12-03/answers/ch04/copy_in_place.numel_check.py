        # why: compares element counts instead of shapes, so a transposed or flattened tensor is copied in.
        pairs = list(named_tensors)
        for name, t in pairs:
            if name not in self.views:
                raise KeyError(f"{name}: no view for this checkpoint name")
            view = self.views[name]
            if view is not None and t.numel() != view.numel():
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(view.shape)}")
        for name, t in pairs:
            view = self.views[name]
            if view is not None:
                view.copy_(t.reshape(view.shape), non_blocking=True)
