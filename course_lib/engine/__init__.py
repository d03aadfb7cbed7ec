"""The serving loop: sequences, paged KV blocks, the scheduler, the model runner, the engine."""
