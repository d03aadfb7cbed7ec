        # why: compares only the data pointer, so a tensor reshaped or cast in place of the same memory passes.
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
            elif now[name].data_ptr() != was.data_ptr:
                lines.append(f"{name}: data_ptr changed from {hex(was.data_ptr)} to {hex(now[name].data_ptr())}")
        return lines
