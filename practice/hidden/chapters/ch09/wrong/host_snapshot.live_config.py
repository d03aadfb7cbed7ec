pin = self.config.is_cuda
tensors = {}
for name, t in kernel_tensors(self.model).items():
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t, non_blocking=pin)
    tensors[name] = host
if pin:
    torch.cuda.synchronize()
# the live config object: an update changes its runtime fields in place, and so the "snapshot"
self.snapshot = {"weight_version": self.weight_version, "tensors": tensors, "config": self.model_config}
return self.snapshot
