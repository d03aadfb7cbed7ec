        # why: walks the current tensors instead of the recorded ones, so a recorded tensor that is gone is never reported.
        if only is not None:
            params = model._params() if hasattr(model, "_params") else dict(model.named_parameters())
            now = {n: params[n] for n in only if n in params}
        else:
            now = kernel_tensors(model, extra)
        lines = []
        for name, t in now.items():
            if name not in self.recorded:
                continue
            was, cur = self.recorded[name], TensorAddress.of(t)
            for f in ("data_ptr", "shape", "dtype", "device"):
                a, b = getattr(was, f), getattr(cur, f)
                if a != b:
                    lines.append(f"{name}: {f} changed from {hex(a) if f == 'data_ptr' else a} to "
                                 f"{hex(b) if f == 'data_ptr' else b}")
        return lines
