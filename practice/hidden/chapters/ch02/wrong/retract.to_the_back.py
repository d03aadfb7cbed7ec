# Joins the end of the queue, behind requests that never started.
seq.status = SequenceStatus.WAITING
self.block_manager.deallocate(seq)
if seq in self.running:
    self.running.remove(seq)
elif seq in self.waiting:
    self.waiting.remove(seq)
self.waiting.append(seq)
if out_of_memory:
    self.num_preemptions += 1
