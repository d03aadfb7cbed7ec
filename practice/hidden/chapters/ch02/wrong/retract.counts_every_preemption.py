# Counts a pause's retract as if the KV pool had run out.
seq.status = SequenceStatus.WAITING
self.block_manager.deallocate(seq)
if seq in self.running:
    self.running.remove(seq)
elif seq in self.waiting:
    self.waiting.remove(seq)
self.waiting.appendleft(seq)
self.num_preemptions += 1
