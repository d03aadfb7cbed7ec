if layer.staging is None:
    return
q, scale = self.quantize(layer.staging)
layer.qweight.copy_(q)
layer.weight_scale.copy_(scale)
layer.last_float_weight = layer.staging   # "for the next update": a float copy per layer, kept
layer.staging, layer.staged_shards = None, set()
