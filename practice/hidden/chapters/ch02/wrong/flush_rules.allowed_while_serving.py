# Flushes whenever asked.
self.last_flush_entries = self.block_manager.flush()
return True
