"""Chapter 05's cost proxies on any machine: the trainer's bucket sender (``BucketSender.payloads``)
sending one step's tensors in reused buffers, counted by ``course_lib.cost``.

``python practice/judge.py cost ch05`` runs ``scenario()`` on your ``course_lib`` and prints
its counts beside the instructor edition's (``REFERENCE``, counted by the maintainers on the
same scenario; a test keeps it current). The GPU speed part stays the graded speed; these
counts say where your design spends: a buffer allocated per bucket instead of reused, an
extra copy of every tensor, a wait per bucket.
"""
PART = "ch05.ipc_sender"
REFERENCE = {"ops": 160, "copies": 32, "allocations": 0, "allocated_bytes": 0, "host_waits": 0}


def scenario():
    """A zero-argument function that sends 32 tensors (8 MB) in 1 MB buckets through one
    sender, releasing each bucket as soon as it is handed over, after a first step that
    made the sender's buffers (not counted)."""
    import torch

    from course_lib.weights.transports.ipc import BucketSender

    gen = torch.Generator().manual_seed(5)
    pairs = [(f"w{i}", torch.randn(65536, generator=gen)) for i in range(32)]
    sender = BucketSender(bucket_bytes=1 << 20, device="cpu")

    def step():
        for receipt, _payload in sender.payloads(pairs):
            sender.release(receipt)
    step()  # the buffers are made once, in the first step
    return step
