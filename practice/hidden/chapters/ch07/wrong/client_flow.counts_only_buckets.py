# Decides that nothing changed from the buckets sent alone: after a disk update landed and the last
# flush failed, it still continues, and the server serves whatever it computed before.
if (named_tensors is None) == (model_path is None):
    raise ValueError("give exactly one of named_tensors or model_path")
times, t0 = {}, time.perf_counter()

def lap(phase: str) -> None:
    nonlocal t0
    now = time.perf_counter()
    times[phase] = now - t0
    t0 = now

pause = self.pause_generation(pause_mode)
lap("pause_s")
sent = {"buckets": 0, "bytes": 0}  # send_buckets counts each bucket as the server accepts it
try:
    times["flush_tries"] = self.flush_until_done(flush_interval_s, flush_tries)
    lap("flush_wait_s")
    if model_path is not None:
        result = self.update_weights_from_disk(model_path, weight_version=weight_version, flush_cache=False)
        sent["bytes"] = result.get("bytes", 0)
    else:
        self.send_buckets(named_tensors, weight_version, bucket_bytes, sent)
    lap("update_s")
    self.flush_until_done(flush_interval_s, flush_tries)
    lap("flush_s")
except EngineError:
    if sent["buckets"] == 0:  # nothing changed: serve the old weights
        self.continue_generation()
    raise
self.continue_generation()
lap("continue_s")
times.update(total_s=sum(v for k, v in times.items() if k.endswith("_s")), buckets=sent["buckets"],
             bytes=sent["bytes"], num_aborted_requests=pause.get("num_aborted_requests", 0))
return times
