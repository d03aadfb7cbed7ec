# Waits for as long as the longest request takes, whatever timeout_s says.
t0 = time.perf_counter()
while self.scheduler.running or self.scheduler.waiting:
    finished = self.step()
    self.outbox += finished
record.wait_s += time.perf_counter() - t0
