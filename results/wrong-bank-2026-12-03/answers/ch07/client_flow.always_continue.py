        # why: continues generation on every EngineError after the pause, even when some buckets already landed.
        if (named_tensors is None) == (model_path is None):
            raise ValueError("give exactly one of named_tensors or model_path")
        times, sent = {}, {"buckets": 0, "bytes": 0}
        t = time.perf_counter()
        paused = self.pause_generation(pause_mode)
        times["pause_s"] = time.perf_counter() - t
        try:
            t = time.perf_counter()
            tries = self.flush_until_done(flush_interval_s, flush_tries)
            times["flush_wait_s"] = time.perf_counter() - t
            t = time.perf_counter()
            if model_path is not None:
                sent["bytes"] += self.update_weights_from_disk(model_path, weight_version=weight_version,
                                                               flush_cache=False).get("bytes", 0)
            else:
                self.send_buckets(named_tensors, weight_version, bucket_bytes, sent)
            times["update_s"] = time.perf_counter() - t
            t = time.perf_counter()
            self.flush_cache()
            times["flush_s"] = time.perf_counter() - t
        except EngineError:
            self.continue_generation()
            raise
        t = time.perf_counter()
        self.continue_generation()
        times["continue_s"] = time.perf_counter() - t
        return {**times, "total_s": sum(times.values()), "flush_tries": tries, "buckets": sent["buckets"],
                "bytes": sent["bytes"], "num_aborted_requests": paused.get("num_aborted_requests", 0)}
