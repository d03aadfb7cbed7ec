if layer.staging is None:
    return
q, scale = self.quantize(layer.staging)
layer.qweight.copy_(q)
layer.weight_scale.copy_(scale)
layer.staging = None
