# "Abort" that keeps the requests and their tokens for later instead of finishing them.
if mode == "abort":
    seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
    for seq in reversed(list(self.scheduler.running)):
        self.scheduler.preempt(seq, out_of_memory=False)
    record.aborted_requests += len(seqs)
    return len(seqs)
if mode == "retract":
    for seq in reversed(list(self.scheduler.running)):
        self.scheduler.preempt(seq, out_of_memory=False)
        seq.retract_record = record
        record.retracted_requests += 1
    return 0
if mode in ("keep", "wait"):
    return 0
raise ValueError(f"unknown pause mode {mode!r}")
