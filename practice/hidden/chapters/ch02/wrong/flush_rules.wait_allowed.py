# Any pause allows a flush, wait included (whose requests are still running).
serving = bool(self.scheduler.running or self.scheduler.waiting)
if serving and not self.paused:
    return False
self.last_flush_entries = self.block_manager.flush()
return True
