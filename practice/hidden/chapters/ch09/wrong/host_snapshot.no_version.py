pin = self.config.is_cuda
tensors = {}
for name, t in kernel_tensors(self.model).items():
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t, non_blocking=pin)
    tensors[name] = host
if pin:
    torch.cuda.synchronize()
runtime = {f: getattr(self.model_config, f) for f in self.model_config.runtime_fields}
# the label is read when rolling back, not when the snapshot is taken
self.snapshot = Snapshot("default", tensors, replace(self.model_config, **runtime))
return self.snapshot
