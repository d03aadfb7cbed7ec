# Refuses whenever a request is in flight, even paused (SGLang's old deadlock in the making).
if self.scheduler.running or self.scheduler.waiting:
    return False
self.last_flush_entries = self.block_manager.flush()
return True
