        # why: hands the payload over as soon as pack returns, without waiting for the GPU stream's copies to finish.
        for group in group_into_buckets(named_tensors, self.bucket_bytes):
            receipt = self._next
            need = bucket.bucket_nbytes(group)
            device = self.device if self.device is not None else group[0][1].device
            if need > self.bucket_bytes:
                packed = bucket.pack(group, device=device)
                self._oversize[receipt] = packed
            else:
                slot = receipt % self.num_buffers
                if slot in self._in_use.values():
                    raise RuntimeError(f"buffer slot {slot} is still in flight; release its bucket first")
                packed = bucket.pack(group, out=self._buffer(slot, need, device))
                self._in_use[receipt] = slot
            self._next += 1
            yield receipt, safe_pickle.serialize(packed)
