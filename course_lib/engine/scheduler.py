"""Continuous batching: each step is either a prefill of waiting requests or one decode
token for every running request; when KV blocks run out, the newest running request is
preempted (its blocks freed; it is re-prefilled later, prompt plus generated tokens)."""
from __future__ import annotations

from collections import deque

from course_lib.config import EngineConfig
from course_lib.engine.block_manager import BlockManager
from course_lib.engine.sequence import Sequence, SequenceStatus
from course_lib.exercises import is_written


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_token_id: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences to run this step, and whether it is a prefill step."""
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:  # admitted ones join running
            seq = self.waiting[0]
            if (num_tokens + seq.num_tokens > self.max_num_batched_tokens
                    or not self.block_manager.can_allocate(seq)):
                break
            self.block_manager.allocate(seq)
            if seq.num_completion_tokens == 0:
                seq.prefix_hit_tokens = seq.num_cached_tokens
            num_tokens += seq.num_tokens - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True

        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def preempt(self, seq: Sequence, out_of_memory: bool = True) -> None:
        """Send ``seq`` back to the queue: its KV is freed and it goes first in line.

        Afterwards ``seq`` is ``SequenceStatus.WAITING``, holds no KV blocks (give them back
        with ``self.block_manager.deallocate(seq)``), is no longer in ``self.running`` and
        is at the head of ``self.waiting``. Its tokens (prompt plus everything generated so
        far) stay, so when it is scheduled again it is prefilled again, all of them, with
        whatever weights the engine holds then, and goes on from its last token.
        ``self.num_preemptions`` counts only preemptions for lack of KV blocks
        (``out_of_memory=True``); a pause in ``retract`` mode calls this with
        ``out_of_memory=False``. A ``seq`` that is not running (already queued) is still
        moved to the head of the queue, never listed twice.
        """
        # BEGIN EXERCISE ch02.retract
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.waiting.appendleft(seq)
        if out_of_memory:
            self.num_preemptions += 1
        # END EXERCISE

    def finish(self, seq: Sequence, reason: dict) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.deallocate(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], version: str) -> list[Sequence]:
        """Append each sampled token; finish sequences that hit EOS or a length limit."""
        finished = []
        # Chapter 02's tags not yet written (student edition): tokens are kept untagged, so
        # chapters 00 and 01 still generate; outputs then report no version spans. Asked
        # once per step (a cached lookup), never by catching the stub's error per token.
        if not is_written(Sequence.tag_token, "ch02.versions"):
            version = None
        for seq, token in zip(seqs, token_ids):
            seq.append_token(token, version)
            if not seq.params.ignore_eos and token == self.eos_token_id:
                self.finish(seq, {"type": "stop", "matched": token})
            elif seq.num_completion_tokens >= seq.params.max_new_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, {"type": "length", "length": seq.num_completion_tokens})
            else:
                continue
            finished.append(seq)
        return finished
