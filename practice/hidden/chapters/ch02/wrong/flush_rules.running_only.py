# Looks only at running requests: flushes while requests wait in the queue.
serving = bool(self.scheduler.running)
if serving and (not self.paused or self.pause_mode == "wait"):
    return False
self.last_flush_entries = self.block_manager.flush()
return True

