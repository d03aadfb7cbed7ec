"""How new weights travel: flattened buckets and their wire format (``bucket.py``,
``safe_pickle.py``), CUDA IPC (``ipc.py``), registered buffers (``registered.py``), a
``torch.distributed`` broadcast (``dist.py``), sparse and byte-level deltas, remote seeding."""
