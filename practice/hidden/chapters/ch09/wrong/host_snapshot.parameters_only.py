pin = self.config.is_cuda
tensors = {}
for name, t in self.model.named_parameters():  # misses buffers: quantization scales, rotary tables
    if t.device.type == "meta":
        continue
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    host.copy_(t.detach(), non_blocking=pin)
    tensors[name] = host
if pin:
    torch.cuda.synchronize()
runtime = {f: getattr(self.model_config, f) for f in self.model_config.runtime_fields}
self.snapshot = Snapshot(self.weight_version, tensors, replace(self.model_config, **runtime))
return self.snapshot
