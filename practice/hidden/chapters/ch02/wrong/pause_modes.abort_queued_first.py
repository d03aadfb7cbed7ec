# Aborts the queued requests' outputs first, then the running ones'.
if mode == "abort":
    seqs = list(self.scheduler.waiting) + list(self.scheduler.running)
    for seq in seqs:
        record.discarded_tokens += seq.num_completion_tokens
        self.outbox.append(self.finish_request(seq, {"type": "abort", "message": message}))
    record.aborted_requests += len(seqs)
    return len(seqs)
if mode == "retract":
    # preempt puts a request first in line: going from the last running request
    # to the first leaves them in their running order at the queue's head.
    for seq in reversed(list(self.scheduler.running)):
        self.scheduler.preempt(seq, out_of_memory=False)
        seq.retract_record = record
        record.retracted_requests += 1
    return 0
if mode in ("keep", "wait"):
    return 0
raise ValueError(f"unknown pause mode {mode!r}; expected abort, wait, keep or retract")

