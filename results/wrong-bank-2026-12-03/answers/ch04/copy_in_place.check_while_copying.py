        # why: checks each tensor's shape just before copying it, so a bad tensor late in the update leaves earlier views written.
        for name, t in named_tensors:
            if name not in self.views:
                raise KeyError(f"{name}: no view for this checkpoint name")
            view = self.views[name]
            if view is None:
                continue
            if tuple(t.shape) != tuple(view.shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(view.shape)}")
            view.copy_(t, non_blocking=True)
