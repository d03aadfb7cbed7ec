"""Runs the model on a scheduled batch: builds the inputs, owns the KV pool, and on GPU
replays CUDA graphs captured for decode batch buckets (1, 2, 4, 8, 16, ...) and, where
the fused kernels serve attention (``layers/fused.py``: every input of a prefill is then
a tensor), for short prefills (up to ``PREFILL_GRAPH_TOKENS[-1]`` new tokens of at most
``PREFILL_GRAPH_SEQS`` sequences): a first token no longer waits for hundreds of kernel
launches from Python.

A captured graph reads the *addresses* its kernels saw at capture: the weights, the KV
pool and the static input buffers below. Replay only refills the input buffers. That is
why every hot update must copy new weights into the existing tensors.
"""
from __future__ import annotations

import torch

from course_lib.capture import no_collection_while_capturing
from course_lib.config import EngineConfig, ModelConfig
from course_lib.engine.sequence import Sequence
from course_lib.layers.attention import Attention, AttentionMetadata
from course_lib.layers.sampler import sample_batch


PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)  # a prefill's new tokens are padded to one of these
PREFILL_GRAPH_SEQS = 32                              # ... and its sequences to this many (or max_num_seqs)
INT64_PER_16_BYTES = 2


def aligned_offsets(sizes) -> tuple[list[int], int]:
    """Where each of several int64 inputs starts in one flat buffer, every one at a 16-byte
    boundary, and the buffer's length. Triton compiles a kernel anew for each alignment of
    its pointer arguments (a multiple of 16 bytes or not): inputs packed back to back start
    at offsets that change with the batch (a prefill of an odd number of tokens moves every
    input after its token ids by 8 bytes), and each new alignment met while serving is a
    compile of the prefill kernels with every stream waiting (an eager prefill meets up to
    three the captured graphs never did; the H200 baselines' one 0.7 s gap fits one)."""
    offsets, n = [], 0
    for size in sizes:
        offsets.append(n)
        n += size + (-size) % INT64_PER_16_BYTES
    return offsets, n


def pack_aligned(tensors) -> torch.Tensor:
    """1-D int64 ``tensors`` in one tensor, laid out as ``aligned_offsets`` places them (one
    copy then refills a captured graph's inputs). The padding repeats a neighbour's value:
    nothing reads it."""
    parts = []
    for t in tensors:
        parts.append(t)
        if t.numel() % INT64_PER_16_BYTES:
            parts.append(t[:1])
    return torch.cat(parts)


def default_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


class ModelRunner:
    def __init__(self, model, model_config: ModelConfig, config: EngineConfig):
        """``config`` is resolved (``EngineConfig.resolved``): it sizes the KV pool
        (``num_kv_blocks``) and says whether to capture CUDA graphs."""
        if config.num_kv_blocks is None:
            raise ValueError("config.num_kv_blocks is None: pass config.resolved(model_config)")
        self.model, self.config = model, config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.num_kv_blocks = num_kv_blocks = config.num_kv_blocks
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        # Padded batch slots write their K/V into one extra block that no sequence owns.
        self.scratch_block = num_kv_blocks
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        a = self.attn_layers[0]
        self.kv_cache = torch.zeros(len(self.attn_layers), 2, num_kv_blocks + 1, config.block_size,
                                    a.num_kv_heads, a.head_dim, dtype=config.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_batch_sizes: list[int] = []
        self.graph_for: dict[int, int] = {}
        # Short prefills are padded (and on a GPU with graphs, replayed) where every layer's
        # attention runs the fused kernels on one rank; eager runs pad the same way, so both
        # use the same kernels on the same shapes (bitwise equal).
        self.prefill_rows = min(config.max_num_seqs, PREFILL_GRAPH_SEQS)
        self.prefill_token_sizes = [t for t in PREFILL_GRAPH_TOKENS if t <= config.max_num_batched_tokens] \
            if config.is_cuda and getattr(model, "tp_size", 1) == 1 and a.fused_fits(self.kv_cache) else []
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        if config.enable_cuda_graph:
            self.capture_cudagraphs()

    # ---- batch preparation -------------------------------------------------------------
    def _int_tensors(self, *lists):
        """Several int64 lists as device tensors through one host-to-device copy (one
        transfer per step instead of one per input: each costs a few microseconds), each
        starting at a 16-byte boundary (``aligned_offsets``)."""
        offsets, _ = aligned_offsets([len(values) for values in lists])
        packed = []
        for values in lists:
            packed += values
            packed += [0] * (len(values) % INT64_PER_16_BYTES)
        flat = torch.tensor(packed, dtype=torch.int64).to(self.device)
        return [flat[o:o + len(values)] for o, values in zip(offsets, lists)]

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _block_tables(self, seqs, width: int, rows: int):
        table = [[self.scratch_block] * width for _ in range(rows)]
        for i, seq in enumerate(seqs):
            table[i][:len(seq.block_table)] = seq.block_table
        return table

    def prefill_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
        """(tokens, sequences) a prefill is padded to, or None where it runs unpadded (on a
        CPU, without the fused kernels, or too large for the captured sizes)."""
        if num_seqs > self.prefill_rows:
            return None
        return next(((t, self.prefill_rows) for t in self.prefill_token_sizes if t >= num_tokens), None)

    def prepare_prefill(self, seqs: list[Sequence], pad: bool = True):
        """(input ids, positions, metadata, index of each sequence's last token). With
        ``pad``, a short prefill on a GPU is padded to ``prefill_shape``: extra tokens
        write their K/V into the scratch block and belong to no sequence; extra sequences
        have no tokens (their rows of the last-token index point at token 0)."""
        input_ids, positions, slots, query_lens, ctx_lens = [], [], [], [], []
        for seq in seqs:
            start = seq.num_cached_tokens
            input_ids += seq.token_ids[start:]
            positions += range(start, seq.num_tokens)
            slots += [self._slot(seq, p) for p in range(start, seq.num_tokens)]
            query_lens.append(seq.num_tokens - start)
            ctx_lens.append(seq.num_tokens)
        width, rows = max(len(s.block_table) for s in seqs), len(seqs)
        if self.config.is_cuda:
            # One block-table width for every prefill on a GPU: a width that changed with the
            # batch would change the table's row stride, an argument the Triton kernels are
            # specialized on (1, a multiple of 16, or other), and a new specialization is
            # compiled in the middle of serving (seconds with every client waiting).
            width = self.max_blocks_per_seq
        shape = self.prefill_shape(len(input_ids), len(seqs)) if pad else None
        if shape is not None:
            tokens, rows = shape
            extra = tokens - len(input_ids)
            input_ids, positions = input_ids + [0] * extra, list(positions) + [0] * extra
            slots = slots + [self.scratch_block * self.block_size] * extra
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        last = [b - 1 for b in starts[1:]] + [0] * (rows - len(seqs))
        starts += [starts[-1]] * (rows - len(seqs))
        ctx = ctx_lens + [0] * (rows - len(seqs))
        table = [b for row in self._block_tables(seqs, width, rows) for b in row]
        ids, pos, slot_t, ctx_t, table_t, starts_t, last_t = self._int_tensors(input_ids, positions, slots, ctx,
                                                                               table, starts, last)
        meta = AttentionMetadata(True, slot_t, ctx_t, table_t.view(rows, width), query_lens, ctx_lens, starts_t)
        return ids, pos, meta, last_t

    def decode_shape(self, batch: int) -> tuple[int, int]:
        """(rows, block-table width) a decode batch is padded to. On GPU eager decode pads
        exactly as the graphs do, so eager and graph runs use the same kernels (bitwise)."""
        if self.config.is_cuda:
            rows = next((b for b in self.graph_batch_sizes or default_graph_batch_sizes(self.config.max_num_seqs)
                         if b >= batch), batch)
            return rows, self.max_blocks_per_seq
        return batch, 0

    def prepare_decode(self, seqs: list[Sequence]):
        rows, width = self.decode_shape(len(seqs))
        width = max(width, max(len(s.block_table) for s in seqs))
        pad = rows - len(seqs)
        input_ids = [s.token_ids[-1] for s in seqs] + [0] * pad
        positions = [s.num_tokens - 1 for s in seqs] + [0] * pad
        slots = [self._slot(s, s.num_tokens - 1) for s in seqs] + [self.scratch_block * self.block_size] * pad
        ctx = [s.num_tokens for s in seqs] + [1] * pad
        table = [b for row in self._block_tables(seqs, width, rows) for b in row]
        ids, pos, slot_t, ctx_t, table_t = self._int_tensors(input_ids, positions, slots, ctx, table)
        return ids, pos, AttentionMetadata(False, slot_t, ctx_t, table_t.view(rows, width))

    # ---- running -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward_logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """Logits [len(seqs), vocab] at each sequence's last token."""
        if is_prefill:
            input_ids, positions, meta, last = self.prepare_prefill(seqs)
            if input_ids.shape[0] in self.prefill_graphs and meta.block_tables.shape[0] == self.prefill_rows:
                return self._replay_prefill(input_ids, positions, meta, last)[: len(seqs)]
            hidden = self.model(input_ids, positions, meta)
            return self.model.compute_logits(hidden[last])[: len(seqs)]  # each sequence's last token
        input_ids, positions, meta = self.prepare_decode(seqs)
        if len(seqs) in self.graph_for:
            return self._replay(len(seqs), input_ids, positions, meta)
        return self.model.compute_logits(self.model(input_ids, positions, meta))[: len(seqs)]

    def replays_graph(self, is_prefill: bool, num_tokens: int, num_seqs: int) -> bool:
        """Whether ``forward_logits`` replays a captured graph for a batch of ``num_seqs``
        sequences with ``num_tokens`` new tokens (else it runs eagerly): for traces."""
        if is_prefill:
            shape = self.prefill_shape(num_tokens, num_seqs)
            return shape is not None and shape[0] in self.prefill_graphs
        return num_seqs in self.graph_for

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        return sample_batch(self.forward_logits(seqs, is_prefill), seqs)

    @torch.inference_mode()
    def prefill_all_logits(self, seq: Sequence) -> torch.Tensor:
        """Logits at every position of a sequence whose blocks are allocated (no cache hits)."""
        input_ids, positions, meta, _ = self.prepare_prefill([seq], pad=False)
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    # ---- CUDA graphs -------------------------------------------------------------------
    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        if not self.config.is_cuda:
            raise RuntimeError("CUDA graphs need device='cuda'")
        with no_collection_while_capturing(collect_first=True):
            self._capture_all()

    def _capture_all(self) -> None:
        sizes = sorted(set(self.config.cuda_graph_batch_sizes or default_graph_batch_sizes(self.config.max_num_seqs)))
        rows, width = max(sizes), self.max_blocks_per_seq
        self.static = {
            "input_ids": torch.zeros(rows, dtype=torch.int64, device=self.device),
            "positions": torch.zeros(rows, dtype=torch.int64, device=self.device),
            "slot_mapping": torch.full((rows,), self.scratch_block * self.block_size, dtype=torch.int64, device=self.device),
            "context_lens": torch.ones(rows, dtype=torch.int64, device=self.device),
            "block_tables": torch.full((rows, width), self.scratch_block, dtype=torch.int64, device=self.device),
        }
        self.graph_outputs: dict[int, torch.Tensor] = {}
        pool = None
        for bs in reversed(sizes):
            s = self.static
            meta = AttentionMetadata(False, s["slot_mapping"][:bs], s["context_lens"][:bs], s["block_tables"][:bs])
            args = (s["input_ids"][:bs], s["positions"][:bs], meta)
            self.model.compute_logits(self.model(*args))  # warm-up: allocations, kernel selection
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.graph_outputs[bs] = self.model.compute_logits(self.model(*args))
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.graph_batch_sizes = sizes
        # batch size -> the captured bucket that serves it
        self.graph_for = {b: next(s for s in sizes if s >= b) for b in range(1, max(sizes) + 1)}
        for tokens in reversed(self.prefill_token_sizes):
            self._capture_prefill(tokens, pool)

    def audited_tensors(self) -> dict:
        """Tensors kernels read besides the model's, audited like the weights: the KV pool,
        the graphs' output buffers and the prefill graphs' input buffers."""
        extras = {"kv_cache": self.kv_cache}
        for bs, out in getattr(self, "graph_outputs", {}).items():
            extras[f"cuda_graph_logits[{bs}]"] = out
        for tokens, (_, inputs, out) in getattr(self, "prefill_graphs", {}).items():
            extras[f"prefill_graph_inputs[{tokens}]"] = inputs
            extras[f"prefill_graph_logits[{tokens}]"] = out
        return extras

    def release_graphs(self) -> None:
        """Destroy every captured graph (the engine runs eagerly afterwards). A
        tensor-parallel rank does this before leaving its process group: graphs that
        captured NCCL collectives hold on to the communicator, and tearing it down while
        they live can wait forever (pytorch/pytorch#115388)."""
        if not (self.graphs or self.prefill_graphs):
            return
        torch.cuda.synchronize(self.device)
        for graph in [*self.graphs.values(), *(g for g, _, _ in self.prefill_graphs.values())]:
            graph.reset()
        self.graphs, self.graph_for, self.graph_batch_sizes = {}, {}, []
        self.prefill_graphs, self.graph_outputs = {}, {}
        torch.cuda.synchronize(self.device)

    def _capture_prefill(self, tokens: int, pool) -> None:
        """A graph for prefills padded to ``tokens`` new tokens and ``prefill_rows``
        sequences; its inputs live in one flat buffer (one copy refills them)."""
        rows, width = self.prefill_rows, self.max_blocks_per_seq
        sizes = [tokens, tokens, tokens, rows, rows * width, rows + 1, rows]
        offsets, total = aligned_offsets(sizes)  # as an eager prefill's, so both run the same compiled kernels
        flat = torch.zeros(total, dtype=torch.int64, device=self.device)
        ids, pos, slots, ctx, table, starts, last = (flat[o:o + n] for o, n in zip(offsets, sizes))
        slots.fill_(self.scratch_block * self.block_size)
        table.fill_(self.scratch_block)
        meta = AttentionMetadata(True, slots, ctx, table.view(rows, width), [tokens], None, starts)
        self.model.compute_logits(self.model(ids, pos, meta)[last])  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool):
            out = self.model.compute_logits(self.model(ids, pos, meta)[last])
        self.prefill_graphs[tokens] = (graph, flat, out)

    def _replay_prefill(self, input_ids, positions, meta, last) -> torch.Tensor:
        graph, flat, out = self.prefill_graphs[input_ids.shape[0]]
        flat.copy_(pack_aligned([input_ids, positions, meta.slot_mapping, meta.context_lens,
                                 meta.block_tables.reshape(-1), meta.query_starts, last]))
        graph.replay()
        return out

    def _replay(self, batch: int, input_ids, positions, meta) -> torch.Tensor:
        bs = self.graph_for[batch]
        s = self.static
        rows, width = meta.block_tables.shape
        assert rows == bs and width == s["block_tables"].shape[1], "decode inputs not padded to the graph's shape"
        s["input_ids"][:bs].copy_(input_ids)
        s["positions"][:bs].copy_(positions)
        s["slot_mapping"][:bs].copy_(meta.slot_mapping)
        s["context_lens"][:bs].copy_(meta.context_lens)
        s["block_tables"][:bs].copy_(meta.block_tables)
        self.graphs[bs].replay()
        return self.graph_outputs[bs][:batch]
