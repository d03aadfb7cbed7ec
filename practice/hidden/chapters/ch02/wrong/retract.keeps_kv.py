# Moves the request to the queue but never gives its KV blocks back.
seq.status = SequenceStatus.WAITING
if seq in self.running:
    self.running.remove(seq)
elif seq in self.waiting:
    self.waiting.remove(seq)
self.waiting.appendleft(seq)
if out_of_memory:
    self.num_preemptions += 1
