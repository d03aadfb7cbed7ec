        # why: reuses a slot's buffer without checking that its previous bucket was released.
        for group in group_into_buckets(named_tensors, self.bucket_bytes):
            receipt = self._next
            need = bucket.bucket_nbytes(group)
            device = self.device if self.device is not None else group[0][1].device
            if need > self.bucket_bytes:
                packed = bucket.pack(group, device=device)
                self._oversize[receipt] = packed
            else:
                slot = receipt % self.num_buffers
                packed = bucket.pack(group, out=self._buffer(slot, need, device))
                self._in_use[receipt] = slot
            if is_cuda(device):
                torch.cuda.current_stream(device).synchronize()
            self._next += 1
            yield receipt, safe_pickle.serialize(packed)
