"""Chapter 03's cost proxies on any machine: the FP8 block quantizer (``quantize_fp8_block``)
on one 1024 x 1536 weight, counted by ``course_lib.cost``.

``python practice/judge.py cost ch03`` runs ``scenario()`` on your ``course_lib`` and prints
its counts beside the instructor edition's (``REFERENCE``, counted by the maintainers on the
same scenario; a test keeps it current). The GPU speed part stays the graded speed; these
counts say where your design spends: a loop over tiles is hundreds of small operations
(kernel launches on a GPU), a padded copy of the weight is an allocation as large as it,
a value read back per tile is a host wait each.
"""
PART = "ch03.quantize_fp8"
REFERENCE = {"ops": 22, "copies": 2, "allocations": 15, "allocated_bytes": 37750369, "host_waits": 1}


def scenario():
    """A zero-argument function that quantizes one weight of 1024 x 1536 (bf16) into FP8 blocks."""
    import torch

    from course_lib.layers.quant import quantize_fp8_block

    w = torch.randn(1024, 1536, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    return lambda: quantize_fp8_block(w)
