"""A request as the engine sees it: its tokens, its KV blocks, and which weights made each token."""
from __future__ import annotations

import itertools
import math
import time
import uuid
from dataclasses import dataclass
from enum import Enum, auto

import torch


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """SGLang's sampling keys. temperature 0 is greedy; ``seed`` makes sampling reproducible."""
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        # Each field by its exact type (JSON's true is not 1, 1.5 is not a seed) and range
        # (NaN and inf are not temperatures): a bad value must never reach the sampler.
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"sampling_params.max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"sampling_params.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"sampling_params.seed must be an integer in [0, 2**63) or null, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"sampling_params.ignore_eos must be true or false, got {self.ignore_eos!r}")

    @classmethod
    def coerce(cls, params) -> "SamplingParams":
        """Accept a SamplingParams, a dict of SGLang keys, or None (defaults)."""
        if params is None:
            return cls()
        if isinstance(params, cls):
            return params
        if isinstance(params, dict):
            unknown = set(params) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown sampling_params keys: {sorted(map(str, unknown))}")
            return cls(**params)
        raise TypeError(f"sampling_params must be a dict or SamplingParams, got {type(params).__name__}")


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = itertools.count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int,
                 rid: str | None = None, default_seed: int = 0, return_logprob: bool = False):
        self.seq_id = next(Sequence._ids)
        self.rid = rid or uuid.uuid4().hex
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0      # tokens whose KV was found in the prefix cache
        self.prefix_hit_tokens = 0      # the same, as seen at this request's first prefill
        self.token_versions: list[str] = []  # weight version that produced each output token
        self.spans: list[dict] = []  # runs of equal versions over the output tokens (tag_token keeps them)
        # With return_logprob: each output token's logprob under the distribution it was
        # drawn from (the sampler leaves it in next_logprob; append_token records it).
        self.return_logprob = return_logprob
        self.output_logprobs: list[float] = []
        self.next_logprob: float | None = None
        self.finish_reason: dict | None = None
        self.kv_epoch = 0               # weight-update count when this request's KV was computed
        self.retract_record = None  # the PauseRecord of the pause that retracted it, until re-prefilled
        self.arrival_time = time.perf_counter()
        self.generator = None
        if params.temperature > 1e-5:
            self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else default_seed)

    def __len__(self):
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int, version: str | None) -> None:
        """Append one generated token and tag it with ``version`` (``tag_token``); None
        leaves it untagged (the student edition before chapter 02's tags are written:
        ``Scheduler.postprocess`` then passes None, so no token is ever lost)."""
        self.token_ids.append(token_id)
        if version is not None:
            self.tag_token(version)

    def tag_token(self, version: str) -> None:
        """Record the weight version that produced the token just appended (and, with
        ``self.return_logprob``, its logprob, which the sampler left in
        ``self.next_logprob``). This is the sequence's whole version bookkeeping: how it
        is kept (``self.spans``, ``self.token_versions``) is up to you, as long as what
        the sequence reports holds.

        Promises, after every ``append_token``:

        - ``self.token_versions`` holds one tag per output token, in order, each the
          version live in the step that sampled that token (an update between two steps
          changes the tag of every later token, never of an earlier one);
        - ``self.version_spans()`` (it returns copies of ``self.spans``) gives one dict
          ``{"version": v, "start": s, "end": e}`` per maximal run of equal versions, in
          order: output tokens ``s`` to ``e - 1`` (``end`` exclusive, counted over output
          tokens, not the prompt) were all made by ``v``, and a neighbouring run has
          another version. The runs cover every output token exactly once (the first
          starts at 0, each starts where the one before ended, the last ends at
          ``len(self.token_versions)``); a version that comes back (v1, v2, v1) gives
          three runs; no output token yet: ``[]``;
        - with ``self.return_logprob``, ``self.output_logprobs`` holds one logprob per
          output token, in order, and ``self.next_logprob`` is None again once its
          logprob is kept; without it, ``self.output_logprobs`` stays empty.
        """
        # BEGIN EXERCISE ch02.versions
        self.token_versions.append(version)
        end = len(self.token_versions)
        if self.spans and self.spans[-1]["version"] == version:
            self.spans[-1]["end"] = end
        else:
            self.spans.append({"version": version, "start": end - 1, "end": end})
        if self.return_logprob:
            self.output_logprobs.append(self.next_logprob)
            self.next_logprob = None
        # END EXERCISE

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def version_spans(self) -> list[dict]:
        """Which weights made which output tokens, as runs (SGLang-style spans): copies
        of ``self.spans``, which ``tag_token`` keeps (see its promises). Reads only."""
        return [dict(span) for span in self.spans]
