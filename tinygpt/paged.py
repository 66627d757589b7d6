"""Day 16: a paged KV cache. Keys and values in fixed-size blocks, lent to sequences on demand.

Day 11's cache reserves max_len positions for every sequence up front. A server does not know
how long a request will run, so most of that reservation holds nothing. A paged cache (the idea
behind vLLM's PagedAttention) keeps one pool of blocks of `block_size` positions per layer and
gives each sequence a block table: position p of a sequence lives in block table[p //
block_size] at offset p % block_size. A sequence takes a new block only when its last one is
full, so at most block_size - 1 slots per sequence stand empty, and a finished sequence gives
its blocks back at once.

    pool        k, v: (n_layers, num_blocks, n_kv_heads, block_size, head_dim)
    allocator   a free list and a reference count per block
    tables      seq_id -> [block ids]; lengths: seq_id -> tokens written

Prefix sharing: `fork(parent, child)` gives the child the parent's blocks (their reference
counts go up), so a common prompt is stored once. Before a sequence writes into a block that
another sequence also references, the block is copied (copy-on-write); full shared blocks are
never written again. `reserve` raises OutOfBlocks (with the blocks needed and free) before it
changes anything, so a scheduler can catch it and preempt a request.

Automatic prefix caching (PagedKVCache(prefix_caching=True)): a full block's keys and values
depend only on the tokens up to its end, so a block can outlive the sequence that computed it.
Each full block gets a key chained from the previous block's key and its own tokens (a block
of the same tokens after a different prefix holds different keys and values, so the tokens
alone would not do). `commit` records the keys of a sequence's full blocks; when the sequence
is freed, a recorded block whose count drops to zero is not wiped but parked in a
least-recently-used list, still findable by its key. `match(tokens)` walks a new prompt's
chain of keys and returns the blocks already computed; `add(seq_id, prefix=blocks)` starts a
sequence on them, so only the rest of its prompt is prefilled. Parked blocks count as free:
`allocate` takes truly free blocks first and then evicts the least recently used parked ones
(forgetting their keys). A matched block is full and never written again (writes go after a
sequence's length); a shared partly filled block is still copied before a write.

`cache.sequence(seq_id)` presents one sequence through day 11's cache interface, so
`TinyGPT.forward(ids, kv_cache=cache.sequence(seq_id))` prefills and decodes it: each layer
writes its new keys and values into the sequence's slots and attends over the gathered blocks.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from tinygpt.model import ModelConfig


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs; nothing was changed."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"out of KV-cache blocks: {needed} needed, {free} free; free a "
                         f"sequence (or preempt one) and try again")
        self.needed, self.free = needed, free


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


DROPPED = -1        # a block table entry released by PagedKVCache.drop_out_of_window (day 21)


class BlockAllocator:
    """A free list of block ids 0 .. num_blocks - 1 and a reference count for each.

    With prefix caching, a block whose count drops to zero while it holds a recorded key
    (`key_of`) is parked in `parked` (least recently used first) instead of the free list; it
    still counts as free, and allocate() evicts parked blocks only when the free list is empty.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = _positive("num_blocks", num_blocks)
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.parked: OrderedDict[int, None] = OrderedDict()
        self.key_of: dict[int, bytes] = {}         # block -> the prefix key it holds
        self.block_of: dict[bytes, int] = {}       # prefix key -> block
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self.parked)

    def allocate(self, n: int = 1) -> list[int]:
        """n fresh blocks (reference count 1 each): free ones first, then the least recently
        used parked ones (their keys are forgotten); OutOfBlocks if fewer are free."""
        if _count("n", n) > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self.parked.popitem(last=False)
                del self.block_of[self.key_of.pop(block)]
                self.evictions += 1
            self.refcount[block] = 1
            blocks.append(block)
        return blocks

    def share(self, block: int) -> None:
        """One more reference to a block in use (a forked sequence), or to a parked block
        found again by its key (it leaves the parked list)."""
        self._check_block(block)
        if self.refcount[block] < 1:
            if block not in self.parked:
                raise ValueError(f"block {block} is free: only a block in use can be shared")
            del self.parked[block]
        self.refcount[block] += 1

    def _check_block(self, block: int) -> None:
        # a negative id would index from the end (and -1 is DROPPED, a released entry)
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be a block id in 0 .. {self.num_blocks - 1}, got "
                             f"{block!r}")

    def release(self, block: int) -> None:
        """Drop one reference; at none left the block returns to the free list, or is parked
        (most recently used) when it holds a recorded key."""
        self._check_block(block)
        if self.refcount[block] < 1:
            raise ValueError(f"block {block} is already free (released twice?)")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self.key_of:
                self.parked[block] = None
            else:
                self._free.append(block)


def block_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The prefix keys of the full blocks of `tokens`, one per block of `block_size` tokens (a
    partly filled last block has none): key i = PagedKVCache.block_key(key i-1, block i's
    tokens), with b"" before the first block. Equal keys mean equal tokens up to the block's
    end, so a block of the same tokens after a different prefix gets a different key."""
    _positive("block_size", block_size)
    keys, key = [], b""
    for i in range(len(tokens) // block_size):
        key = PagedKVCache.block_key(key, tokens[i * block_size:(i + 1) * block_size])
        keys.append(key)
    return keys


class PagedKVCache:
    """Paged keys and values for every layer of a model; see the module docstring.

    n_layers, n_kv_heads, head_dim: the model's. block_size: positions per block. num_blocks:
    the pool's size. max_len: the most positions a sequence may hold (the model's window).
    prefix_caching: keep full blocks findable by their prefix key after their sequences end
    (see the module docstring).

    latent=kv_lora_rank (day 21, multi-head latent attention; for_model passes it): the pool
    holds, per layer and token, the latent and the RoPE key side by side (n_kv_heads 1,
    head_dim kv_lora_rank + qk_rope_head_dim), the absorbed decode's single shared key; its
    values are the key's first kv_lora_rank columns (the latent), so there is no second pool:
    `v` is `k`. The runner reads it (tinygpt.runner); write / gather / sequence, which store
    separate keys and values, refuse.

    window=W (day 21; for_model passes cfg.sliding_window when EVERY layer is windowed):
    a query at position t reads keys t - W + 1 .. t only, so once a sequence holds L
    positions no later query reads a block whose positions all lie before L - W + 1.
    drop_out_of_window releases such blocks (the scheduler calls it after every step) and
    marks their table entries DROPPED: a long sequence then holds about W / block_size + 1
    blocks, however long it grows. The runner reads a dropped entry as block 0, whose
    contents its window mask hides. A hybrid model's full-attention layers need every key:
    window stays 0 and nothing is dropped.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, num_blocks: int,
                 block_size: int = 16, max_len: int = 1024,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 prefix_caching: bool = False, latent: int = 0, window: int = 0) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an integer >= 0 (0: keep every block), got "
                             f"{window!r}")
        self.window = window
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        if isinstance(latent, bool) or not isinstance(latent, int) or latent < 0 or (
                latent and (n_kv_heads != 1 or not latent < head_dim)):
            raise ValueError(f"latent must be 0 or kv_lora_rank (< head_dim={head_dim}, with "
                             f"n_kv_heads=1), got latent={latent!r}, n_kv_heads={n_kv_heads}")
        self.latent = latent
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads),
                            ("head_dim", head_dim), ("block_size", block_size),
                            ("max_len", max_len)):
            _positive(name, value)
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.block_size, self.max_len = block_size, max_len
        self.allocator = BlockAllocator(num_blocks)
        shape = (n_layers, num_blocks, n_kv_heads, block_size, head_dim)
        with torch.inference_mode(False):
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = self.k if latent else torch.zeros(shape, device=device, dtype=dtype)
        self.tables: dict[Hashable, list[int]] = {}
        self.lengths: dict[Hashable, int] = {}
        self.prefix_caching = prefix_caching
        self.keys: dict[Hashable, list[bytes]] = {}      # seq_id -> keys of its full blocks

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_blocks: int, block_size: int = 16,
                  prefix_caching: bool = False) -> PagedKVCache:
        """A pool shaped for `model` (a TinyGPT), on its device and in its dtype."""
        cfg = getattr(model, "cfg", None)
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"model must carry a tinygpt ModelConfig as .cfg, got {cfg!r}")
        weight = next(model.parameters())
        if cfg.attention == "mla":          # day 21: one latent + RoPE key per token and layer
            return cls(cfg.n_layers, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                       num_blocks=num_blocks, block_size=block_size, max_len=cfg.max_seq_len,
                       device=weight.device, dtype=weight.dtype,
                       prefix_caching=prefix_caching, latent=cfg.kv_lora_rank)
        # a tensor-parallel shard (tinygpt.parallel) caches only its own KV heads
        n_kv_heads = getattr(model, "cache_kv_heads", cfg.n_kv_heads)
        window = 0 if cfg.full_attention_layers else cfg.sliding_window     # day 21
        return cls(cfg.n_layers, n_kv_heads, cfg.head_dim, num_blocks=num_blocks,
                   block_size=block_size, max_len=cfg.max_seq_len, device=weight.device,
                   dtype=weight.dtype, prefix_caching=prefix_caching, window=window)

    # -- sequences ---------------------------------------------------------------------------

    def _known(self, seq_id: Hashable) -> list[int]:
        if seq_id not in self.tables:
            raise KeyError(f"no sequence {seq_id!r} in the cache; add() it first")
        return self.tables[seq_id]

    def add(self, seq_id: Hashable, prefix: Sequence[int] = ()) -> None:
        """A new sequence: empty, or starting on `prefix`, full blocks that match() found for
        its first tokens (it takes a reference to each; its length is theirs)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        prefix = list(prefix)
        if prefix and not self.prefix_caching:
            raise ValueError("a prefix of cached blocks needs prefix_caching=True")
        for block in prefix:
            if block not in self.allocator.key_of:
                raise ValueError(f"block {block} holds no cached prefix")
            self.allocator.share(block)
        self.tables[seq_id], self.lengths[seq_id] = prefix, len(prefix) * self.block_size
        self.keys[seq_id] = [self.allocator.key_of[b] for b in prefix]

    # -- prefix caching ----------------------------------------------------------------------

    @staticmethod
    def block_key(previous: bytes, tokens: Sequence[int]) -> bytes:
        """The key of a full block: a digest of the previous block's key and this block's
        tokens, so equal keys mean equal token prefixes (up to a SHA-256 collision)."""
        digest = hashlib.sha256(previous)
        digest.update(b"".join(int(t).to_bytes(8, "little") for t in tokens))
        return digest.digest()

    def match(self, tokens: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """The cached blocks that hold the longest prefix of `tokens` made of full blocks (at
        most max_blocks of them); changes nothing. Empty without prefix caching."""
        if max_blocks is not None:
            _count("max_blocks", max_blocks)
        if not self.prefix_caching:
            return []
        full = len(tokens) // self.block_size
        if max_blocks is not None:
            full = min(full, max_blocks)
        found = []
        for key in block_keys(tokens[:full * self.block_size], self.block_size):
            block = self.allocator.block_of.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def commit(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Record the keys of the sequence's full blocks; `tokens`: at least its first
        length // block_size * block_size tokens (the ones whose keys and values it holds).
        A block whose key another block already holds stays unrecorded (freed as usual)."""
        if not self.prefix_caching:
            return
        table, keys, size = self._known(seq_id), self.keys[seq_id], self.block_size
        for i in range(len(keys), self.lengths[seq_id] // size):
            key = self.block_key(keys[-1] if keys else b"",
                                 tokens[i * size:(i + 1) * size])
            keys.append(key)
            block = table[i]
            if key not in self.allocator.block_of and block not in self.allocator.key_of:
                self.allocator.block_of[key], self.allocator.key_of[block] = block, key

    def needs_commit(self, seq_id: Hashable) -> bool:
        """Whether the sequence has full blocks whose keys commit() has not recorded yet."""
        return (self.prefix_caching
                and self.lengths[seq_id] // self.block_size > len(self.keys[seq_id]))

    @property
    def cached_blocks(self) -> int:
        """Blocks findable by a prefix key (in use or parked)."""
        return len(self.allocator.key_of)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """A new sequence `child` that shares every block (the whole prefix) of `parent`."""
        blocks = self._known(parent)
        if child in self.tables:
            raise ValueError(f"sequence {child!r} is already in the cache")
        for block in blocks:
            if block != DROPPED:
                self.allocator.share(block)
        self.tables[child], self.lengths[child] = list(blocks), self.lengths[parent]
        self.keys[child] = list(self.keys.get(parent, []))

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence; its blocks return to the pool unless another sequence shares them."""
        for block in self._known(seq_id):
            if block != DROPPED:
                self.allocator.release(block)
        del self.tables[seq_id], self.lengths[seq_id]
        self.keys.pop(seq_id, None)

    def drop_out_of_window(self, seq_id: Hashable) -> int:
        """Release the sequence's blocks that no later query reads (window > 0): those whose
        positions all lie before length - window + 1. Returns how many were released; their
        table entries become DROPPED (a prefix of the table; positions keep their index)."""
        table = self._known(seq_id)
        if not self.window:
            return 0
        oldest = self.lengths[seq_id] - self.window + 1      # the oldest key still read
        released = 0
        for b in range(min(max(oldest, 0) // self.block_size, len(table))):
            if table[b] != DROPPED:
                self.allocator.release(table[b])
                table[b], released = DROPPED, released + 1
        return released

    def blocks_needed(self, seq_id: Hashable, n_new: int) -> int:
        """Blocks `reserve(seq_id, n_new)` would take from the pool (copy-on-write included)."""
        table, length = self._known(seq_id), self.lengths[seq_id]
        needed = math.ceil((length + n_new) / self.block_size) - len(table)
        partial = length % self.block_size != 0
        if n_new > 0 and partial and self.allocator.refcount[table[-1]] > 1:
            needed += 1                          # the shared, partly filled block is copied
        return max(needed, 0)

    def reserve(self, seq_id: Hashable, n_new: int) -> None:
        """Make positions length .. length + n_new - 1 of `seq_id` writable: copy a shared
        partly filled last block, then append fresh blocks. Raises OutOfBlocks (and changes
        nothing) when the pool is short, ValueError past max_len."""
        table, length = self._known(seq_id), self.lengths[seq_id]
        if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 0:
            raise ValueError(f"n_new must be an int >= 0, got {n_new!r}")
        if length + n_new > self.max_len:
            raise ValueError(f"sequence {seq_id!r} would hold {length + n_new} positions; at "
                             f"most max_len={self.max_len}")
        needed = self.blocks_needed(seq_id, n_new)
        if needed > self.allocator.num_free:
            raise OutOfBlocks(needed, self.allocator.num_free)
        if n_new and length % self.block_size and self.allocator.refcount[table[-1]] > 1:
            shared = table[-1]
            (copy,) = self.allocator.allocate(1)
            self.k[:, copy] = self.k[:, shared]
            if self.v is not self.k:
                self.v[:, copy] = self.v[:, shared]
            self.allocator.release(shared)
            table[-1] = copy
        missing = math.ceil((length + n_new) / self.block_size) - len(table)
        if missing > 0:
            table.extend(self.allocator.allocate(missing))

    def slots(self, seq_id: Hashable, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets), each (n,) long, of positions start .. start + n - 1."""
        table = self._known(seq_id)
        if start < 0 or n < 0:      # a negative position would index from the table's end
            raise ValueError(f"start and n must be >= 0, got start={start}, n={n}")
        positions = torch.arange(start, start + n)
        index = positions // self.block_size
        if n and int(index[-1]) >= len(table):
            raise ValueError(f"positions up to {start + n - 1} of {seq_id!r} are not reserved")
        blocks = torch.tensor(table, dtype=torch.long)[index]
        return blocks.to(self.k.device), (positions % self.block_size).to(self.k.device)

    def _check_not_latent(self, what: str) -> None:
        if self.latent:
            raise ValueError(f"{what}() stores separate keys and values; this pool holds "
                             f"latents (latent={self.latent}, multi-head latent attention): "
                             f"tinygpt.runner.ModelRunner reads and writes them")

    def write(self, layer: int, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor,
              start: int) -> None:
        """Store k, v (n_kv_heads, T, head_dim) at positions start .. start + T - 1."""
        self._check_not_latent("write")
        blocks, offsets = self.slots(seq_id, start, k.shape[1])
        self.k[layer, blocks, :, offsets] = k.transpose(0, 1)
        self.v[layer, blocks, :, offsets] = v.transpose(0, 1)

    def gather(self, layer: int, seq_id: Hashable, end: int) -> tuple[torch.Tensor, ...]:
        """Keys and values of positions 0 .. end - 1: (n_kv_heads, end, head_dim) each."""
        self._check_not_latent("gather")
        blocks, offsets = self.slots(seq_id, 0, end)
        blocks = blocks.clamp(min=0)                 # DROPPED: out of every query's window
        return (self.k[layer, blocks, :, offsets].transpose(0, 1),
                self.v[layer, blocks, :, offsets].transpose(0, 1))

    def sequence(self, seq_id: Hashable) -> PagedSequence:
        """The sequence as a `kv_cache` for TinyGPT.forward (batch 1)."""
        self._check_not_latent("sequence")
        self._known(seq_id)
        return PagedSequence(self, seq_id)

    # -- bookkeeping -------------------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError if the tables and the allocator disagree: every block's
        reference count must equal the number of tables that hold it, and no free block may
        be in a table (a table that reuses a block another sequence still holds breaks it)."""
        held: dict[int, int] = {}
        for table in self.tables.values():
            for block in table:
                if block != DROPPED:
                    held[block] = held.get(block, 0) + 1
        free = set(self.allocator._free) | set(self.allocator.parked)
        for block in range(self.allocator.num_blocks):
            count = self.allocator.refcount[block]
            assert count == held.get(block, 0), (
                f"block {block}: reference count {count}, but {held.get(block, 0)} tables hold it")
            assert (count == 0) == (block in free), f"block {block}: free list disagrees"
            assert block not in self.allocator.parked or block in self.allocator.key_of, (
                f"block {block} is parked without a key")
        for key, block in self.allocator.block_of.items():
            assert self.allocator.key_of.get(block) == key, f"block {block}: keys disagree"

    @property
    def used_blocks(self) -> int:
        return self.allocator.num_blocks - self.allocator.num_free

    def empty_fraction(self) -> float:
        """Share of the slots of the blocks in use that hold no token (a slot shared by
        forked sequences counts once); 0.0 when no block is in use."""
        filled = {(table[p // self.block_size], p % self.block_size)
                  for seq_id, table in self.tables.items()
                  for p in range(self.lengths[seq_id]) if table[p // self.block_size] != DROPPED}
        slots = self.used_blocks * self.block_size
        return 0.0 if slots == 0 else 1 - len(filled) / slots


class _PagedLayer:
    """One layer of a PagedSequence: day 11's LayerKVCache.update over the pool."""

    def __init__(self, cache: PagedKVCache, seq_id: Hashable, layer: int) -> None:
        self.cache, self.seq_id, self.layer = cache, seq_id, layer

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (1, H_kv, T, hd) at start; return positions 0 .. start+T-1 as
        (1, H_kv, start + T, hd) each."""
        self.cache.write(self.layer, self.seq_id, k[0], v[0], start)
        keys, values = self.cache.gather(self.layer, self.seq_id, start + k.shape[2])
        return keys[None], values[None]


class PagedSequence:
    """One sequence of a PagedKVCache behind day 11's KVCache interface (dynamic, batch 1)."""

    static = False

    def __init__(self, cache: PagedKVCache, seq_id: Hashable) -> None:
        self.cache, self.seq_id = cache, seq_id
        self.layers = [_PagedLayer(cache, seq_id, i) for i in range(cache.n_layers)]

    @property
    def length(self) -> int:
        return self.cache.lengths[self.seq_id]

    def start_forward(self, cfg: ModelConfig, idx: torch.Tensor,
                      input_pos: torch.Tensor | None, weight: torch.Tensor) -> int:
        """Checks for TinyGPT.forward(idx (1, T), kv_cache=self); reserves the T positions."""
        batch, n_new = idx.shape
        if batch != 1:
            raise ValueError(f"a paged sequence runs batch 1, got batch {batch}")
        if cfg.n_layers != self.cache.n_layers:
            raise ValueError(f"the cache has {self.cache.n_layers} layers but the model has "
                             f"n_layers={cfg.n_layers}")
        if weight.dtype != self.cache.k.dtype or weight.device != self.cache.k.device:
            raise ValueError(f"the cache holds {self.cache.k.dtype} on {self.cache.k.device}; "
                             f"the model runs {weight.dtype} on {weight.device}")
        if input_pos is not None:
            raise ValueError("a paged sequence writes after its length: leave input_pos None")
        if self.length + n_new > cfg.max_seq_len:
            raise ValueError(f"positions up to {self.length + n_new - 1} exceed max_seq_len="
                             f"{cfg.max_seq_len}")
        self.cache.reserve(self.seq_id, n_new)
        return self.length

    def advance(self, n_new: int) -> None:
        self.cache.lengths[self.seq_id] += n_new


# ------------------------------------------------------------------------------------------------
# fragmentation: how much reserved KV memory holds no token


@dataclass(frozen=True)
class Fragmentation:
    tokens: int              # tokens the sequences hold
    contiguous_slots: int    # slots day 11's cache reserves: max_len per sequence
    paged_slots: int         # slots a paged cache holds: whole blocks per sequence
    contiguous_empty: float  # fraction of the contiguous reservation that holds no token
    paged_empty: float       # the same for the paged cache


def fragmentation(lengths: Sequence[int], max_len: int, block_size: int) -> Fragmentation:
    """Empty share of the KV memory reserved for sequences of `lengths` tokens: per-sequence
    max_len preallocation against blocks of block_size (no sharing)."""
    _positive("max_len", max_len)
    _positive("block_size", block_size)
    if not lengths or any(not 1 <= n <= max_len for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of ints in [1, max_len={max_len}]")
    tokens = sum(lengths)
    contiguous = len(lengths) * max_len
    paged = sum(math.ceil(n / block_size) * block_size for n in lengths)
    return Fragmentation(tokens, contiguous, paged, 1 - tokens / contiguous, 1 - tokens / paged)
