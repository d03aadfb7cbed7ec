        # why: records the bucket as in flight only after the caller resumes the generator, not before handing it over.
        for group in group_into_buckets(named_tensors, self.bucket_bytes):
            receipt = self._next
            need = bucket.bucket_nbytes(group)
            device = self.device if self.device is not None else group[0][1].device
            big = need > self.bucket_bytes
            slot = receipt % self.num_buffers
            if not big and slot in self._in_use.values():
                raise RuntimeError(f"buffer slot {slot} is still in flight; release its bucket first")
            packed = bucket.pack(group, device=device) if big else bucket.pack(group, out=self._buffer(slot, need, device))
            if is_cuda(device):
                torch.cuda.current_stream(device).synchronize()
            self._next += 1
            yield receipt, safe_pickle.serialize(packed)
            if big:
                self._oversize[receipt] = packed
            else:
                self._in_use[receipt] = slot
