"""course_lib: a small inference engine whose weights can be hot-updated, provably equal to a restart.

    from course_lib import Engine, SamplingParams
    engine = Engine("path/to/hf_checkpoint")           # device="cuda" on a GPU
    engine.generate(["Hello"], {"max_new_tokens": 8, "temperature": 0})
"""
from course_lib.engine.engine import Engine
from course_lib.engine.sequence import SamplingParams

__all__ = ["Engine", "SamplingParams"]
__version__ = "0.1.0"
