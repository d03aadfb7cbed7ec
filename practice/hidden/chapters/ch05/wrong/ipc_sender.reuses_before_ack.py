# Never checks the slot: packs into a buffer the engine has not acknowledged.
for group in group_into_buckets(named_tensors, self.bucket_bytes):
    receipt, self._next = self._next, self._next + 1
    slot = receipt % self.num_buffers
    need = bucket.bucket_nbytes(group)
    device = self.device or group[0][1].device
    if need > self.bucket_bytes:  # one tensor larger than a bucket travels alone
        packed = bucket.pack(group, device=device)
        self._oversize[receipt] = packed
    else:
        packed = bucket.pack(group, out=self._buffer(slot, need, device))
        self._in_use[receipt] = slot
    if is_cuda(device):
        torch.cuda.current_stream().synchronize()  # the bytes are there before the engine reads
    yield receipt, safe_pickle.serialize(packed)
