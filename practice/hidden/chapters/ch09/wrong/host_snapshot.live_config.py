pin = self.config.is_cuda
tensors = {}
for name, t in kernel_tensors(self.model).items():
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t, non_blocking=pin)
    tensors[name] = host
if pin:
    torch.cuda.synchronize()
# the live config object: an update changes its runtime fields in place, and so the "snapshot"
self.snapshot = Snapshot(self.weight_version, tensors, self.model_config)
return self.snapshot
