        # why: writes the data pointers in decimal instead of hex.
        if only is not None:
            params = model._params() if hasattr(model, "_params") else dict(model.named_parameters())
            now = {n: params[n] for n in only if n in params}
            names = [n for n in self.recorded if n in now]
        else:
            now = kernel_tensors(model, extra)
            names = list(self.recorded)
        lines = []
        for name in names:
            was = self.recorded[name]
            if name not in now:
                lines.append(f"{name}: no longer present")
                continue
            cur = TensorAddress.of(now[name])
            for f in ("data_ptr", "shape", "dtype", "device"):
                a, b = getattr(was, f), getattr(cur, f)
                if a != b:
                    lines.append(f"{name}: {f} changed from {a} to {b}")
        return lines
