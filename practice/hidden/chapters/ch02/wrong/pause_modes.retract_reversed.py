# Sends the running requests back first to last: preempt puts each at the head, so they end up reversed.
if mode == "abort":
    seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
    for seq in seqs:
        record.discarded_tokens += seq.num_completion_tokens
        self.outbox.append(self.finish_request(seq, {"type": "abort", "message": message}))
    record.aborted_requests += len(seqs)
    return len(seqs)
if mode == "retract":
    for seq in list(self.scheduler.running):
        self.scheduler.preempt(seq, out_of_memory=False)
        seq.retract_record = record
        record.retracted_requests += 1
    return 0
if mode in ("keep", "wait"):
    return 0
raise ValueError(f"unknown pause mode {mode!r}")
