# Looks the slot up among the receipts in flight (the dict's keys), not among their slots:
# right while receipts and slots coincide (the first round), wrong once they part.
for group in group_into_buckets(named_tensors, self.bucket_bytes):
    receipt, self._next = self._next, self._next + 1
    slot = receipt % self.num_buffers
    if slot in self._in_use:
        raise RuntimeError(f"buffer {slot} is still in flight: release() it first")
    need = bucket.bucket_nbytes(group)
    device = self.device or group[0][1].device
    if need > self.bucket_bytes:
        packed = bucket.pack(group, device=device)
        self._oversize[receipt] = packed
    else:
        packed = bucket.pack(group, out=self._buffer(slot, need, device))
        self._in_use[receipt] = slot
    if is_cuda(device):
        torch.cuda.current_stream().synchronize()
    yield receipt, safe_pickle.serialize(packed)
