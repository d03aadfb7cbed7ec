"""Reference answer for find-the-rebind: every write goes into the existing storage."""
from __future__ import annotations

import torch


def fused_rows(model, param_name, shard_id):
    """Row indices of fused parameter ``param_name`` that checkpoint shard ``shard_id`` fills."""
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    start, size = module.shard_rows(shard_id)  # q/k/v or gate/up: the layer says where its shard lands
    return torch.arange(start, start + size, device=module.weight.device)


def load_into(model, named_tensors) -> None:
    """Put checkpoint tensors (name, tensor) into the model's parameters."""
    params = dict(model.named_parameters())
    for name, tensor in named_tensors:
        target = model.map_checkpoint_name(name)
        if target is None:              # e.g. lm_head.weight when it is tied to the embedding
            continue
        param_name, shard_id = target
        param = params[param_name]
        tensor = tensor.to(param.dtype)
        if shard_id is None:
            param.data.copy_(tensor)
        else:
            rows = fused_rows(model, param_name, shard_id)
            param.data.index_copy_(0, rows, tensor)  # the trailing underscore: in place
