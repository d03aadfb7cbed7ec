# Flushes under the right rules but reports nothing dropped.
serving = bool(self.scheduler.running or self.scheduler.waiting)
if serving and (not self.paused or self.pause_mode == "wait"):
    return False
self.block_manager.flush()
self.last_flush_entries = 0
return True
