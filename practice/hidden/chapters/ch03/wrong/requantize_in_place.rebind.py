if layer.staging is None:
    return
q, scale = self.quantize(layer.staging)
layer.qweight = q                # rebinds: a captured graph keeps reading the old memory
layer.weight_scale = scale
layer.staging, layer.staged_shards = None, set()
