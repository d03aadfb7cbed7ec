if layer.staging is None:
    return
q, scale = self.quantize(layer.staging)
layer.qweight.copy_(q)
layer.staging, layer.staged_shards = None, set()
