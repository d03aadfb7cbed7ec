# Packs an oversized tensor into the fixed buffer meant for normal buckets.
for group in group_into_buckets(named_tensors, self.bucket_bytes):
    receipt, self._next = self._next, self._next + 1
    slot = receipt % self.num_buffers
    if slot in self._in_use.values():
        raise RuntimeError(f"buffer {slot} still holds an unacknowledged bucket: release() it first "
                           f"(at most {self.num_buffers} buckets may be in flight)")
    need = bucket.bucket_nbytes(group)
    device = self.device or group[0][1].device
    packed = bucket.pack(group, out=self._buffer(slot, need, device))
    self._in_use[receipt] = slot
    if is_cuda(device):
        torch.cuda.current_stream().synchronize()  # the bytes are there before the engine reads
    yield receipt, safe_pickle.serialize(packed)
