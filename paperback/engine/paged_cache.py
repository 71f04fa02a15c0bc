"""Physical KV storage in blocks, in any KV format, and one engine step's view of it.

`PagedKVPool` stores, per layer, its cache group's `num_blocks` blocks of
`block_size` token slots in that layer's format (a `KVPolicy` picks it):

- **native** layers (fp32 / fp16 / bf16) keep a (num_blocks, Hkv, bs, D)
  tensor for keys and one for values, written token by token;
- **quantized** layers keep each encoded field of their codecs per block
  (codes, scales, minimums: (num_blocks, Hkv, rows, width)), packed as the
  codec stores them. A block is encoded once, when all its tokens are older
  than the format's exact recent window; until then its tokens sit in a
  small exact staging area in 16-bit (a few blocks per running sequence), so
  the recent window and partly filled key groups stay exact, as in
  `paperback.kv.QuantizedKVCache`.

What a query reads depends on its position alone: a query at p reads block b
as stored only when b lies wholly outside p's exact recent window
(`_Layer.stored_blocks`). A step that encodes blocks keeps their exact copies
until the next step, and its queries that come before the end of those
blocks' window read the copies (`ExactSplit`), so a prompt prefilled in one
step, in chunks, or again after a preemption gives the same tokens.

Retention: a quantized layer's sink blocks (`sink=`) stay in staging, exact,
for the sequence's life.

Prefix-cache hits, in every format: a block is committed to the prefix
cache once its bytes are final in every layer (encoded, where a quantized
layer encodes it); a sequence that goes (finished, or preempted to be
recomputed) first encodes the full blocks of its recent window so that
they become final too (`finalize`). A quantized format's hit also needs
what a computed prefix leaves in staging: the sinks and the blocks the
next query still reads exact. Those come from staging slots that kept a
cached block's exact copy when their sequence let go of them
(`paperback.engine.staging`), or from a running sequence's staging; the
hit stops before the first block whose exact copy is nowhere
(`usable_prefix`), so a hit reads what computing the prefix would have. Layers are stored by cache group
(`paperback.engine.cache_groups`): layers that free blocks alike (every
token kept, a sliding window, sinks plus a window) share block ids and a
block table, and each group's storage holds its own pool's blocks. After
each step the engine gives back, group by group, the blocks wholly before
the group's window (sinks aside).

The block managers decide which blocks a sequence owns; the pool stores
bytes and, per sequence, which staging slots hold its unencoded blocks.

`StepBatch` packs the new tokens of several sequences into one row: linear
layers run once over all of them, and attention writes each sequence's keys
and values, then reads its blocks back through `paged_attention`, decoding
quantized blocks a few at a time. On CPU, the sequences that add one token
(decoding) are written and attended together by the C kernel
(`paged_decode_attention`), which reads their blocks in place, native or
encoded (every format but PN-Mix), and the staged ones from staging.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paperback.engine.block_manager import EVICTED, NoFreeBlocks
from paperback.engine.paged_attention import ExactSplit, paged_attention
from paperback.engine.pool_layout import PoolLayout
from paperback.engine.staging import StagingSlots
from paperback.errors import PaperbackError
from paperback.kernels.attention import (ExactStaging, decode_kernel_available, native_source,
                                         paged_decode_attention)
from paperback.kv.cache import staging_dtype
from paperback.kv.policy import KVPolicy
from paperback.kv.families import NATIVE
from paperback.models.cache import KVCache
from paperback.models.config import ModelConfig


class _Layer:
    def __init__(self, policy: KVPolicy, idx: int, config: ModelConfig, group: int, layout: PoolLayout,
                 stage_dtype: torch.dtype, device, amax=None):
        block_size, num_blocks = layout.block_size, layout.num_blocks[group]
        self.group = group  # the cache group whose block ids and table it uses
        self.block_size = block_size
        self.scheme = policy.scheme_for(idx)
        self.native = self.scheme.is_native
        self.window = self.scheme.window or config.window_of(idx)  # what its attention reads
        self.sink_blocks = -(-self.scheme.sink // block_size)
        if not self.native and self.scheme.sink % block_size:
            raise PaperbackError(f"layer {idx}: sink={self.scheme.sink} is not a whole number of the pool's "
                                 f"{block_size}-token blocks")
        shape = (config.num_kv_heads, block_size, config.head_dim)
        if self.native:
            store = NATIVE[self.scheme.dtype]
            self.keys = torch.zeros((num_blocks, *shape), dtype=store, device=device)
            self.values = torch.zeros((num_blocks, *shape), dtype=store, device=device)
            # What the C decode kernel reads in place (CPU, a dtype it knows), else None.
            self.kernel_sources = ((native_source(self.keys), native_source(self.values))
                                   if decode_kernel_available(self.keys) else None)
            return
        self.key_codec, self.value_codec = self.scheme.layer_codecs(idx, None if amax is None else {idx: amax})
        probe = torch.zeros((1, *shape), device=device)
        self.key_fields = {n: torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype, device=device)
                           for n, t in self.key_codec.field_shapes(probe).items()}
        self.value_fields = {n: torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype, device=device)
                             for n, t in self.value_codec.field_shapes(probe).items()}
        self.stage_keys = torch.zeros((layout.stage_blocks, *shape), dtype=stage_dtype, device=device)
        self.stage_values = torch.zeros((layout.stage_blocks, *shape), dtype=stage_dtype, device=device)
        sources = (self.key_codec.kernel_source(self.key_fields), self.value_codec.kernel_source(self.value_fields))
        self.kernel_sources = sources if None not in sources and decode_kernel_available(self.stage_keys) else None
        # PN-Mix ranks key channels on what a sequence shows before its first block is encoded: that many
        # positions, whatever the steps were.
        self.observe_until = (self.sink_blocks + 1) * block_size + self.scheme.residual

    def stored_blocks(self, positions: torch.Tensor) -> torch.Tensor:
        """Per query position p, the leading blocks p reads as stored (encoded): those wholly older than p's
        exact recent window, sinks aside. By position alone, never by where a step ended."""
        return ((positions + 1 - self.scheme.residual).clamp(min=0) // self.block_size).clamp(min=self.sink_blocks)

    def tensors(self) -> list[torch.Tensor]:
        if self.native:
            return [self.keys, self.values]
        return [*self.key_fields.values(), *self.value_fields.values()]


def _copy_rows(t: torch.Tensor, ids: torch.Tensor, data: torch.Tensor) -> None:
    """t[ids] = data along the first dimension; FP8 as its bytes (index_copy_ has no FP8 kernel on CPU)."""
    if t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8):
        t, data = t.view(torch.uint8), data.view(torch.uint8)
    t.index_copy_(0, ids, data.to(t.device))


@dataclass
class SwappedKV:
    """A swapped-out sequence's bytes in host memory: per layer its blocks' tensors (as `_Layer.tensors`
    lists them, blocks in table order) and, for a quantized layer, its staged keys and values; which
    blocks were staged, and how far each quantized layer had encoded."""

    layers: list[list[torch.Tensor]]
    stage_blocks: list[int]
    flushed: dict[int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for saved in self.layers for t in saved)


@dataclass
class _SeqState:
    stage: dict[int, int] = field(default_factory=dict)  # block index -> staging slot
    flushed: dict[int, int] = field(default_factory=dict)  # quantized layer -> leading blocks encoded
    shared: int = 0  # leading blocks that came from the prefix cache, final already: never encoded again
    names: list[bytes] = field(default_factory=list)  # its blocks' prefix-cache hashes (the block manager's list)

    @property
    def all_flushed(self) -> int:
        return min(self.flushed.values(), default=0)


class PagedKVPool:
    def __init__(self, config: ModelConfig, policy: KVPolicy, layout: PoolLayout, dtype: torch.dtype,
                 device: torch.device | str = "cpu", kv_amax: dict | None = None):
        """layout: blocks per cache group, block size and staging (`paperback.engine.pool_layout`).
        kv_amax: {layer: (key amax, value amax)} from paperback.kv.calibrate, for calibrated FP8 layers."""
        self.layout = layout
        self.block_size = block_size = layout.block_size
        self.groups = list(layout.groups)
        self.num_blocks = list(layout.num_blocks)
        self.device = torch.device(device)
        self.dtype = dtype  # blocks are encoded from staging in the compute dtype, as the dense cache encodes
        self.stage_dtype = staging_dtype(dtype)
        group_of = {i: g for g, group in enumerate(self.groups) for i in group.layers}
        self.layers = [_Layer(policy, i, config, group_of[i], layout, self.stage_dtype, device,
                              (kv_amax or {}).get(i)) for i in range(config.num_layers)]
        for group in self.groups:
            for i in group.layers:
                scheme = self.layers[i].scheme
                if group.window and not scheme.is_native and group.window <= scheme.residual:
                    raise PaperbackError(f"layer {i}: its window of {group.window} tokens must exceed {scheme.label}'s "
                                         f"exact recent window of {scheme.residual}: tokens are encoded before they "
                                         "are freed")
        # Layers whose storage the C decode kernel reads in place (CPU; a dtype or codec it knows).
        self.kernel_decodes = [layer.kernel_sources is not None for layer in self.layers]
        # Sink blocks some quantized layer reads from staging keep their slot for the sequence's life.
        self.stage_sink_blocks = max((layer.sink_blocks for layer in self.layers if not layer.native), default=0)
        quantized = [layer.scheme for layer in self.layers if not layer.native]
        self.quantized_layers = [i for i, layer in enumerate(self.layers) if not layer.native]
        self.quantized = bool(quantized)
        for s in quantized:
            if block_size % s.flush_group:
                raise ValueError(f"block size {block_size} is not a multiple of {s.label}'s group of "
                                 f"{s.flush_group} tokens")
        self.staging = StagingSlots(layout.stage_blocks if self.quantized else 0)
        self.seqs: dict[int, _SeqState] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the block pool plus the exact staging area."""
        staging = [t for layer in self.layers if not layer.native for t in (layer.stage_keys, layer.stage_values)]
        blocks = [t for layer in self.layers for t in layer.tensors()]
        return sum(t.numel() * t.element_size() for t in blocks + staging)

    # --- sequences ----------------------------------------------------------------------------------------
    def _ready(self, layer: _Layer, tokens: int) -> int:
        """Leading blocks a sequence of `tokens` tokens has encoded in a quantized layer: those wholly older
        than its exact recent window."""
        return max(0, tokens - layer.scheme.residual) // self.block_size

    def start(self, seq_id: int, cached_blocks: int = 0, names: list[bytes] | None = None) -> None:
        """A sequence admitted with `cached_blocks` leading blocks already final (prefix-cache hits, named by
        `names`, the block manager's hashes of its blocks): its staging gets the exact copies a computed prefix
        would have left there (`usable_prefix` said they exist)."""
        flushed = {i: self._ready(self.layers[i], cached_blocks * self.block_size) for i in self.quantized_layers}
        state = _SeqState(flushed=flushed, shared=cached_blocks, names=names if names is not None else [])
        if cached_blocks and self.quantized:
            self._copy_exact(state, self._exact_needed(cached_blocks))
        self.seqs[seq_id] = state

    def name(self, seq_id: int, names: list[bytes]) -> None:
        """The block manager's hashes of the sequence's blocks (its list, which grows as blocks commit)."""
        self.seqs[seq_id].names = names

    def release(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id, None)
        if state:
            for b in list(state.stage):
                self._give_back(state, b)

    def _give_back(self, state: _SeqState, b: int) -> None:
        # A committed block's slot keeps its exact copy, named, for a later prefix hit.
        self.staging.give_back(state.stage.pop(b), state.names[b] if b < len(state.names) else None)

    def _exact_needed(self, cached_blocks: int) -> list[int]:
        """Blocks a sequence holding `cached_blocks` computed blocks has in staging: its sinks and those its
        next query reads exact in some quantized layer."""
        tokens = cached_blocks * self.block_size
        first = min(self._ready(self.layers[i], tokens) for i in self.quantized_layers)
        return sorted(set(range(min(cached_blocks, self.stage_sink_blocks))) | set(range(first, cached_blocks)))

    def _live_copies(self) -> dict[bytes, int]:
        """Committed blocks that running sequences hold in staging (their sinks, mostly): name -> slot."""
        return {state.names[b]: slot for state in self.seqs.values() for b, slot in state.stage.items()
                if b < len(state.names)}

    def usable_prefix(self, names: list[bytes]) -> int:
        """Of a cached prefix of len(names) blocks (their hashes), how many leading blocks a new sequence can
        take: the most whose exact copies (`_exact_needed`) are kept, with staging slots free to copy them to.
        Every block where no layer stages exact tokens."""
        if not self.quantized or not names:
            return len(names)
        live = self._live_copies()
        for cached in range(len(names), 0, -1):
            need = [names[b] for b in self._exact_needed(cached)]
            pinned = {n for n in need if n in self.staging.named}
            if all(n in pinned or n in live for n in need) and self.staging.available - len(pinned) >= len(need):
                return cached
        return 0

    def _copy_exact(self, state: _SeqState, blocks: list[int]) -> None:
        """Copy the kept exact copies of `blocks` (named in state.names) into fresh staging slots of the state."""
        live = self._live_copies()
        names = [state.names[b] for b in blocks]
        sources = []
        for n in names:
            slot = self.staging.copy_of(n)
            sources.append(live[n] if slot is None else slot)
        targets = [self.staging.take(keep=frozenset(names)) for _ in blocks]
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        dst = torch.tensor(targets, dtype=torch.long, device=self.device)
        for i in self.quantized_layers:
            layer = self.layers[i]
            for t in (layer.stage_keys, layer.stage_values):
                t.index_copy_(0, dst, t.index_select(0, src))
        state.stage.update(zip(blocks, targets))

    def finalize(self, seq_id: int, tables: list[list[int]], computed: int) -> int:
        """Before a sequence goes: encode the full blocks it holds only exact (its recent window), so that their
        bytes are final and the prefix cache can keep them. Returns its leading final blocks."""
        state = self.seqs[seq_id]
        full = computed // self.block_size
        for i in self.quantized_layers:
            layer = self.layers[i]
            table = tables[layer.group]
            blocks = [b for b in range(max(state.flushed[i], layer.sink_blocks, state.shared), full)
                      if table[b] != EVICTED]
            self._encode(layer, [state.stage[b] for b in blocks], [table[b] for b in blocks])
            state.flushed[i] = max(state.flushed[i], full)
        return self.final_blocks(seq_id, computed)

    def _encode(self, layer: _Layer, slots: list[int], block_ids: list[int]) -> None:
        """Encode staged blocks (their slots) into the layer's blocks `block_ids`, all at once."""
        if not slots:
            return
        src = torch.tensor(slots, dtype=torch.long, device=self.device)
        dst = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for codec, stage, fields in ((layer.key_codec, layer.stage_keys, layer.key_fields),
                                     (layer.value_codec, layer.stage_values, layer.value_fields)):
            for name, t in codec.encode(stage.index_select(0, src).to(self.dtype)).items():
                _copy_rows(fields[name], dst, t)

    def fork(self, parent: int, child: int) -> None:
        """The child gets its own copies of the parent's staged (unencoded) blocks."""
        src = self.seqs[parent]
        self._free_encoded(src)  # between steps: what the last step encoded is read exact no more
        dst = self.seqs[child] = _SeqState(flushed=dict(src.flushed), shared=src.shared)
        for b, slot in src.stage.items():
            dst.stage[b] = new = self.staging.take()
            for layer in self.layers:
                if not layer.native:
                    layer.stage_keys[new] = layer.stage_keys[slot]
                    layer.stage_values[new] = layer.stage_values[slot]

    def swap_out(self, seq_id: int, tables: list[list[int]]) -> SwappedKV:
        """Copy a sequence's blocks (every layer, from its group's table) and its staged exact tokens to host
        memory, and give back its staging; the caller then frees its blocks (`paperback.engine.swap`)."""
        state = self.seqs[seq_id]
        if self.quantized:
            self._free_encoded(state)  # between steps: blocks every layer has encoded are read encoded only
        held = self._held_ids(tables)
        stage_blocks = sorted(state.stage)
        slots = torch.tensor([state.stage[b] for b in stage_blocks], dtype=torch.long, device=self.device)
        layers = []
        for layer in self.layers:
            ids = held[layer.group]
            saved = [t.index_select(0, ids).cpu() for t in layer.tensors()]
            if not layer.native:
                saved += [t.index_select(0, slots).cpu() for t in (layer.stage_keys, layer.stage_values)]
            layers.append(saved)
        self.release(seq_id)
        return SwappedKV(layers, stage_blocks, dict(state.flushed))

    def _held_ids(self, tables: list[list[int]]) -> list[torch.Tensor]:
        """Per cache group, the block ids a table holds (its evicted places aside)."""
        return [torch.tensor([b for b in table if b != EVICTED], dtype=torch.long, device=self.device)
                for table in tables]

    def can_swap_in(self, swapped: SwappedKV) -> bool:
        return self.staging.available >= len(swapped.stage_blocks)

    def swap_in(self, seq_id: int, swapped: SwappedKV, tables: list[list[int]]) -> None:
        """A swapped-out sequence's blocks copied into its new blocks (`tables`, from the block managers), and
        its staged tokens into fresh staging slots."""
        if not self.can_swap_in(swapped):
            raise NoFreeBlocks("no free staging blocks to swap a sequence back in")
        state = self.seqs[seq_id] = _SeqState(flushed=dict(swapped.flushed))
        for b in swapped.stage_blocks:
            state.stage[b] = self.staging.take()
        slots = torch.tensor([state.stage[b] for b in swapped.stage_blocks], dtype=torch.long, device=self.device)
        held = self._held_ids(tables)
        for layer, saved in zip(self.layers, swapped.layers):
            stored = layer.tensors()
            for t, data in zip(stored, saved):
                _copy_rows(t, held[layer.group], data)
            if not layer.native:
                _copy_rows(layer.stage_keys, slots, saved[len(stored)])
                _copy_rows(layer.stage_values, slots, saved[len(stored) + 1])

    def prepare(self, seq_id: int, first_pos: int, seq_len: int) -> None:
        """Staging slots for the blocks that positions [first_pos, seq_len) will be written to (and back, for
        blocks the last step encoded)."""
        if not self.quantized:
            return
        state = self.seqs[seq_id]
        self._free_encoded(state)
        for b in range(first_pos // self.block_size, -(-seq_len // self.block_size)):
            if b >= state.all_flushed and b not in state.stage:
                state.stage[b] = self.staging.take()

    def _free_encoded(self, state: _SeqState) -> None:
        """Staging slots of the blocks every quantized layer has encoded: the last step's early queries read
        them exact, if at all; no later query does, so the slots go back."""
        done = state.all_flushed
        for b in [b for b in state.stage if self.stage_sink_blocks <= b < done]:
            self._give_back(state, b)

    def copy_block(self, group: int, src: int, dst: int) -> None:
        """Copy-on-write of a main block in every layer of a cache group (staged blocks are per sequence
        already)."""
        for layer in self.layers:
            if layer.group == group:
                for t in layer.tensors():
                    t[dst] = t[src]

    # --- per layer: write, read, flush ---------------------------------------------------------------------
    def write(self, layer_idx: int, seq_id: int, table: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (Hkv, T, D) of the tokens at `positions`."""
        layer = self.layers[layer_idx]
        if layer.native and len(positions) == 1:  # a decode token: one slot, written through a plain view
            pos = int(positions[0])
            block, slot = int(table[pos // self.block_size]), pos % self.block_size
            layer.keys[block, :, slot] = k[:, 0]
            layer.values[block, :, slot] = v[:, 0]
            return
        blocks, slots = positions // self.block_size, positions % self.block_size
        if layer.native:
            layer.keys[table[blocks], :, slots] = k.transpose(0, 1).to(layer.keys.dtype)
            layer.values[table[blocks], :, slots] = v.transpose(0, 1).to(layer.values.dtype)
            return
        stage = self.seqs[seq_id].stage
        where = torch.tensor([stage[b] for b in blocks.tolist()], dtype=torch.long, device=self.device)
        layer.stage_keys[where, :, slots] = k.transpose(0, 1).to(layer.stage_keys.dtype)
        layer.stage_values[where, :, slots] = v.transpose(0, 1).to(layer.stage_values.dtype)

    def reader(self, layer_idx: int, seq_id: int, table: torch.Tensor, dtype: torch.dtype, exact: bool = False):
        """Logical block indices -> (keys, values) (n, Hkv, bs, D): encoded blocks decoded, staged ones as is.
        exact: every block from staging (blocks this step encoded, for its queries that still read them exact)."""
        layer = self.layers[layer_idx]
        # index_select: a third of advanced indexing's time for these gathers.
        if layer.native:
            def read_native(idx: torch.Tensor):
                ids = table.index_select(0, idx)
                return layer.keys.index_select(0, ids), layer.values.index_select(0, ids)

            return read_native
        state = self.seqs[seq_id]
        flushed, sinks = state.flushed[layer_idx], layer.sink_blocks

        def read_encoded(idx: torch.Tensor):
            ids = table.index_select(0, idx)
            return (layer.key_codec.decode({n: t.index_select(0, ids) for n, t in layer.key_fields.items()}, dtype),
                    layer.value_codec.decode({n: t.index_select(0, ids) for n, t in layer.value_fields.items()},
                                             dtype))

        def read_staged(idx: torch.Tensor):
            slots = torch.tensor([state.stage[b] for b in idx.tolist()], dtype=torch.long, device=self.device)
            keys, values = layer.stage_keys.index_select(0, slots), layer.stage_values.index_select(0, slots)
            return keys.to(dtype), values.to(dtype)

        if exact:
            return read_staged

        def read(idx: torch.Tensor):
            # In block order: exact sinks, encoded blocks, then the staged recent blocks.
            parts = [(read_staged, idx < sinks), (read_encoded, (idx >= sinks) & (idx < flushed)),
                     (read_staged, idx >= max(flushed, sinks))]
            blocks = [reader(idx[chosen]) for reader, chosen in parts if chosen.any()]
            if len(blocks) == 1:
                return blocks[0]
            return torch.cat([k for k, _ in blocks]), torch.cat([v for _, v in blocks])

        return read

    def flush(self, layer_idx: int, seq_id: int, table: torch.Tensor, seq_len: int) -> tuple[int, int]:
        """Encode this layer's blocks of the sequence that the step's last query (at seq_len - 1) reads as
        stored: those wholly older than its exact recent window. Returns [lo, hi), the blocks encoded now,
        which the step's earlier queries may still read exact (their staging is kept until the next step).

        Called after the step's tokens are written and before attention reads,
        as the dense quantized cache does, so both read the same bytes.
        """
        layer = self.layers[layer_idx]
        if layer.native:
            return 0, 0
        state = self.seqs[seq_id]
        ready = max(0, seq_len - layer.scheme.residual) // self.block_size
        lo = max(state.flushed[layer_idx], layer.sink_blocks)
        blocks = range(max(lo, state.shared), ready)  # a cached prefix's blocks are encoded already
        if blocks:
            self._encode(layer, [state.stage[b] for b in blocks], table[blocks.start:blocks.stop].tolist())
        state.flushed[layer_idx] = max(state.flushed[layer_idx], ready)
        return lo, max(lo, ready)

    def final_blocks(self, seq_id: int, computed: int) -> int:
        """Leading blocks of the sequence whose bytes are final (the ones the prefix cache may share)."""
        full = computed // self.block_size
        return min(full, self.seqs[seq_id].all_flushed) if self.quantized else full

    def observe(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, first_pos: int) -> None:
        """q (1, H, T, D), k (1, Hkv, T, D) of positions first_pos.. : the part before `observe_until`."""
        layer = self.layers[layer_idx]
        if not layer.native and first_pos < layer.observe_until:
            n = layer.observe_until - first_pos
            layer.key_codec.observe(q[:, :, :n], k[:, :, :n])


@dataclass(frozen=True)
class StepSequence:
    """One sequence's part of a step: `num_new` tokens ending at position seq_len - 1."""

    seq_id: int
    num_new: int
    seq_len: int
    block_tables: tuple[torch.Tensor, ...]  # per cache group: (blocks,) long, EVICTED (-1) where given back


class StepBatch(KVCache):
    """The cache a model runs a packed row of several sequences' new tokens over: it owns their attention."""

    owns_attention = True

    def __init__(self, pool: PagedKVPool, seqs: list[StepSequence]):
        self.pool = pool
        self.seqs = seqs
        for s in seqs:
            pool.prepare(s.seq_id, s.seq_len - s.num_new, s.seq_len)
        device = pool.device
        self.positions = torch.cat([torch.arange(s.seq_len - s.num_new, s.seq_len, device=device) for s in seqs])
        # Each sequence's logical block indices, the same in every layer.
        self.logical = [torch.arange(-(-s.seq_len // pool.block_size), device=device) for s in seqs]
        # Sequences adding one token (decoding) attend together in native layers, through the C (CPU) kernel.
        self.decoding = [i for i, s in enumerate(seqs) if s.num_new == 1] if any(pool.kernel_decodes) else []
        if self.decoding:
            offsets = torch.tensor([0] + [s.num_new for s in seqs]).cumsum(0)[:-1]
            self.decode_rows = offsets[self.decoding]
            self.decode_lengths = torch.tensor([seqs[i].seq_len for i in self.decoding])
            self.decode_slots = (self.decode_lengths - 1) % pool.block_size
        self._decode_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stage_tables: dict[tuple, torch.Tensor] = {}
        self._decode_stage_slots: torch.Tensor | None = None  # staging slot of each decoding token's block

    def _decode_table(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoding sequences' block tables in a cache group, padded into one tensor, and the block each
        one's new token goes to (built once per step and group)."""
        if group not in self._decode_tables:
            tables = [self.seqs[i].block_tables[group] for i in self.decoding]
            padded = torch.zeros((len(tables), max(len(t) for t in tables)), dtype=torch.long)
            for row, table in enumerate(tables):
                padded[row, :len(table)] = table
            last = (self.decode_lengths - 1) // self.pool.block_size
            self._decode_tables[group] = padded, padded[torch.arange(len(tables)), last]
        return self._decode_tables[group]

    def _stage_table(self, layer_idx: int, layer, width: int) -> torch.Tensor:
        """(decoding sequences, width): the staging slot of each block a quantized layer reads exact (its sinks
        and the blocks not encoded yet), -1 for those read encoded; as `PagedKVPool.reader` splits them."""
        seqs = [self.pool.seqs[self.seqs[i].seq_id] for i in self.decoding]
        key = (layer.sink_blocks, width, tuple(state.flushed[layer_idx] for state in seqs))
        if key not in self._stage_tables:  # layers of one recent window and sinks share it
            rows, cols, slots = [], [], []
            for row, state in enumerate(seqs):
                flushed = state.flushed[layer_idx]
                for b, slot in state.stage.items():
                    if b < layer.sink_blocks or b >= flushed:
                        rows.append(row)
                        cols.append(b)
                        slots.append(slot)
            table = torch.full((len(seqs), width), -1, dtype=torch.long)
            table[rows, cols] = torch.tensor(slots, dtype=torch.long)
            self._stage_tables[key] = table
        return self._stage_tables[key]

    def _attend_decoding_together(self, layer_idx: int, layer, q, k, v, scaling: float, window: int | None,
                                  sink: int, out: torch.Tensor) -> None:
        rows = self.decode_rows
        tables, blocks = self._decode_table(layer.group)
        new_k, new_v = k[0, :, rows].transpose(0, 1), v[0, :, rows].transpose(0, 1)
        staging = None
        if layer.native:
            layer.keys[blocks, :, self.decode_slots] = new_k.to(layer.keys.dtype)
            layer.values[blocks, :, self.decode_slots] = new_v.to(layer.values.dtype)
        else:  # into staging, then each sequence encodes the blocks that left its recent window
            if self._decode_stage_slots is None:
                self._decode_stage_slots = torch.tensor(
                    [self.pool.seqs[self.seqs[i].seq_id].stage[int(b)] for i, b in
                     zip(self.decoding, (self.decode_lengths - 1) // self.pool.block_size)], dtype=torch.long)
            layer.stage_keys[self._decode_stage_slots, :, self.decode_slots] = new_k.to(layer.stage_keys.dtype)
            layer.stage_values[self._decode_stage_slots, :, self.decode_slots] = new_v.to(layer.stage_values.dtype)
            for i in self.decoding:
                s = self.seqs[i]
                self.pool.flush(layer_idx, s.seq_id, s.block_tables[layer.group], s.seq_len)
            staging = ExactStaging(layer.stage_keys, layer.stage_values,
                                   self._stage_table(layer_idx, layer, tables.shape[1]))
        key_source, value_source = layer.kernel_sources
        out[0, :, rows] = paged_decode_attention(
            q[0, :, rows].transpose(0, 1), key_source, value_source, tables, self.decode_lengths, scaling, window,
            sink, staging, num_kv_heads=k.shape[1], block_size=self.pool.block_size).transpose(0, 1)

    def attention(self, layer_idx: int, q, k, v, scaling: float, window: int | None) -> torch.Tensor:
        """q (1, H, N, D), k and v (1, Hkv, N, D) for the packed tokens; returns (1, H, N, D).
        The layer's retention window, where its scheme sets one, replaces `window` (never both)."""
        out = torch.empty_like(q)
        start = 0
        bs = self.pool.block_size
        layer = self.pool.layers[layer_idx]
        window, sink = layer.window, layer.scheme.sink if layer.scheme.window else 0
        together = self.decoding if self.pool.kernel_decodes[layer_idx] else []
        if together:
            self._attend_decoding_together(layer_idx, layer, q, k, v, scaling, window, sink, out)
        skip = set(together)
        for i, (s, logical) in enumerate(zip(self.seqs, self.logical)):
            part = slice(start, start + s.num_new)
            start += s.num_new
            if i in skip:
                continue
            table = s.block_tables[layer.group]
            first_pos = s.seq_len - s.num_new
            self.pool.observe(layer_idx, q[:, :, part], k[:, :, part], first_pos)
            self.pool.write(layer_idx, s.seq_id, table, self.positions[part], k[0, :, part], v[0, :, part])
            lo, hi = self.pool.flush(layer_idx, s.seq_id, table, s.seq_len)
            read = self.pool.reader(layer_idx, s.seq_id, table, q.dtype)
            split = None
            if hi > lo:  # blocks encoded now: the step's queries before the last may still read them exact
                stored = layer.stored_blocks(self.positions[part])
                lo = max(lo, int(stored[0]))
                if lo < hi:
                    split = ExactSplit(lo, hi, self.pool.reader(layer_idx, s.seq_id, table, q.dtype, exact=True),
                                       stored)
            out[0, :, part] = paged_attention(q[0, :, part], read, logical, s.seq_len, bs, scaling, window, sink,
                                              split=split)
        return out
