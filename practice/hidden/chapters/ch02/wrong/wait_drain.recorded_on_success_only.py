# Records the wait when the drain finishes, but not when it gives up.
t0 = time.perf_counter()
while self.scheduler.running or self.scheduler.waiting:
    if time.perf_counter() - t0 > timeout_s:
        raise TimeoutError(f"in-flight requests did not finish within {timeout_s} s; "
                           f"the weights were not changed")
    finished = self.step()
    self.outbox += finished
record.wait_s += time.perf_counter() - t0
