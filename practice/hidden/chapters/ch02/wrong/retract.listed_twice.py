# Forgets that a queued request is already in the queue.
seq.status = SequenceStatus.WAITING
self.block_manager.deallocate(seq)
if seq in self.running:
    self.running.remove(seq)
self.waiting.appendleft(seq)
if out_of_memory:
    self.num_preemptions += 1
