# Throws the generated tokens away and starts over from the prompt.
seq.status = SequenceStatus.WAITING
self.block_manager.deallocate(seq)
del seq.token_ids[seq.num_prompt_tokens:]
seq.token_versions.clear()
if seq in self.running:
    self.running.remove(seq)
elif seq in self.waiting:
    self.waiting.remove(seq)
self.waiting.appendleft(seq)
if out_of_memory:
    self.num_preemptions += 1
