tensors = dict(kernel_tensors(self.model))  # the live tensors themselves: they follow the next update
runtime = {f: getattr(self.model_config, f) for f in self.model_config.runtime_fields}
self.snapshot = Snapshot(self.weight_version, tensors, replace(self.model_config, **runtime))
return self.snapshot
