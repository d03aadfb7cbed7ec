# Runs the requests to completion but throws away the outputs of those that finish in the drain.
t0 = time.perf_counter()
try:
    while self.scheduler.running or self.scheduler.waiting:
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"in-flight requests did not finish within {timeout_s} s; "
                               f"the weights were not changed")
        self.step()
finally:
    record.wait_s += time.perf_counter() - t0
