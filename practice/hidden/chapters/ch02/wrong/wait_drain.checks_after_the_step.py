# Checks the clock after each step: a drain past its limit still runs one more step.
t0 = time.perf_counter()
try:
    while self.scheduler.running or self.scheduler.waiting:
        finished = self.step()
        self.outbox += finished
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"in-flight requests did not finish within {timeout_s} s; "
                               f"the weights were not changed")
finally:
    record.wait_s += time.perf_counter() - t0
