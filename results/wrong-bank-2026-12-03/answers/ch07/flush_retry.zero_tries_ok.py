        # why: does not refuse tries < 1; with tries=0 it makes one call anyway.
        n = 0
        while True:
            n += 1
            try:
                self.flush_cache()
                return n
            except EngineError as exc:
                if not exc.retryable or n >= tries:
                    raise
                time.sleep(interval_s)
