# Drains the running requests only: a queued one is left to run on the new weights.
t0 = time.perf_counter()
try:
    while self.scheduler.running:
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"in-flight requests did not finish within {timeout_s} s; "
                               f"the weights were not changed")
        finished = self.step()  # returns (and clears) the outbox, plus new outputs
        self.outbox += finished
finally:
    record.wait_s += time.perf_counter() - t0

