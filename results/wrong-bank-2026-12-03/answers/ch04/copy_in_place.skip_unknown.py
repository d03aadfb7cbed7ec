        # why: skips names with no entry in views like tied ones, instead of refusing them with KeyError.
        pairs = list(named_tensors)
        for name, t in pairs:
            view = self.views.get(name)
            if view is not None and tuple(t.shape) != tuple(view.shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(view.shape)}")
        for name, t in pairs:
            view = self.views.get(name)
            if view is not None:
                view.copy_(t, non_blocking=True)
