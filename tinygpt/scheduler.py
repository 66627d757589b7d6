"""Day 17: the scheduler of a serving engine. Which sequences run in the next step, and how much.

A continuous-batching engine runs one model step after another. Before each step the scheduler
decides, from the waiting queue and the running batch, which sequences take part and how many
of their tokens they feed. It owns no tensors: it reads and changes the paged KV cache's block
bookkeeping (tinygpt.paged.PagedKVCache: add, reserve, free, blocks_needed, lengths, max_len,
block_size and the allocator's num_free and num_blocks; with prefix caching also match, commit,
needs_commit and allocator.parked; with a sliding window, window and drop_out_of_window) and
never its keys and values, so its policy can be read, tested and changed without a model.

A sequence's tokens are its prompt and its outputs so far. `num_computed` of them have keys and
values in the cache; the rest are pending. A prefill is a sequence with many pending tokens, a
decode one with exactly one (the token it sampled last step), and a preempted sequence simply
has num_computed = 0 again. So one rule covers all three: a step feeds a sequence the next
`n` of its pending tokens, and when they reach its last token, the step's logits for that
position give it its next token.

Each step, in this order (SYLLABUS.md, day 17):

1. decodes: every running sequence with one pending token gets it, oldest first. Its next
   position may need a new block; when the pool has none, the NEWEST running sequence is
   preempted (its blocks freed, its progress recomputed later) until there is room. The newest
   has the least work to lose, and the oldest requests keep moving, so none starves.
   Day 19: a constrained request whose grammar forced a run of tokens after its sampled one
   has several pending tokens past its prompt; it is fed them here, in one pass, as a short
   chunk (as many as the budget leaves after one token for each decode behind it).
2. prefill chunks: running sequences still in their prompt get up to the rest of the step's
   token budget, oldest first. Decodes go first so that a long prompt never stalls the
   sequences already streaming: that is chunked prefill.
3. admission: waiting sequences, first come first served, join while there is a free slot
   (max_running), budget left, and free blocks for ALL their pending tokens (reserved at
   once, so a prefill never runs out halfway). The first that does not fit stops admission:
   skipping ahead would let short requests starve a long one forever.

A finished sequence leaves with `finish`, which frees its blocks at once, so the next step can
admit someone in its place (continuous batching).

With a prefix-caching cache (tinygpt.paged), admission first asks the cache for the full blocks
that already hold the sequence's first tokens (a shared system prompt, the history a chat
resends every turn, or its own work before a preemption). The sequence starts on them with
num_computed at their end and prefills only the rest; at least its last token is always fed,
because the step needs that position's logits to sample. After every step, the blocks that
became full are committed (their keys recorded), so the next request can find them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

STATUSES = ("waiting", "running", "finished")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(eq=False)
class Seq:
    """One request as the scheduler sees it.

    id: any hashable, unique in the engine. prompt_ids: the prompt (non-empty).
    max_new_tokens: the most outputs it may produce. arrival: orders it (first come first
    served; the step it arrived at, or a time).
    """

    id: Hashable
    prompt_ids: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0          # tokens whose keys and values are in the cache
    status: str = "waiting"
    preemptions: int = 0
    cache_prefix: bool = True      # may start on cached blocks (False: prefill every token)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens to feed before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def max_positions(self) -> int:
        """The most cache positions it can ever hold: its last token is never fed back."""
        return len(self.prompt_ids) + self.max_new_tokens - 1

    def tokens(self, start: int, n: int) -> list[int]:
        """Its tokens start .. start + n - 1 (prompt, then outputs)."""
        ids = self.prompt_ids + self.output_ids
        return ids[start:start + n]


@dataclass(frozen=True)
class Scheduled:
    """One sequence's share of a step: feed tokens start .. start + n - 1. `samples`: the
    chunk reaches the sequence's last token, so the step gives it a next token."""

    seq: Seq
    start: int
    n: int

    @property
    def samples(self) -> bool:
        return self.start + self.n == self.seq.num_tokens


@dataclass
class StepPlan:
    """What schedule() decided: the step's work, and who was preempted or admitted for it."""

    scheduled: list[Scheduled]
    preempted: list[Seq]
    admitted: list[Seq]

    @property
    def num_tokens(self) -> int:
        return sum(s.n for s in self.scheduled)


class Scheduler:
    """Waiting queue, running batch and the step policy of the module docstring.

    cache: a tinygpt.paged.PagedKVCache, or anything with its add / reserve / free /
    blocks_needed, lengths, max_len, block_size and allocator.num_free / num_blocks (and, when
    it has prefix_caching true, match / commit / needs_commit and allocator.parked; when its
    window is not 0, drop_out_of_window). max_running: sequences in the batch at once.
    token_budget: tokens one step may feed in all (decodes count one each; prefill chunks
    take what is left); at least max_running.
    """

    def __init__(self, cache, *, max_running: int = 32, token_budget: int = 256) -> None:
        self.cache = cache
        self.max_running = _positive("max_running", max_running)
        self.token_budget = _positive("token_budget", token_budget)
        if token_budget < max_running:
            raise ValueError(f"token_budget ({token_budget}) must be >= max_running "
                             f"({max_running}): every running sequence needs one token a step "
                             f"to decode, or the newest would wait for the oldest to finish")
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []          # oldest first
        self.num_preemptions = 0
        self.prefix_query_tokens = 0          # tokens of admitted sequences
        self.prefix_hit_tokens = 0            # ... of them found in cached blocks

    # -- sequences come and go -------------------------------------------------------------

    def add(self, seq: Seq) -> None:
        """Queue a new sequence. ValueError if it could never fit: more positions than the
        cache's max_len, or more blocks than the whole pool."""
        if not isinstance(seq, Seq):
            raise TypeError(f"seq must be a tinygpt.scheduler.Seq, got {type(seq).__name__}")
        if not seq.prompt_ids:
            raise ValueError("seq.prompt_ids is empty: a sequence needs at least one token")
        _positive("seq.max_new_tokens", seq.max_new_tokens)
        if seq.max_positions > self.cache.max_len:
            raise ValueError(f"prompt ({len(seq.prompt_ids)}) + max_new_tokens "
                             f"({seq.max_new_tokens}) - 1 = {seq.max_positions} positions; the "
                             f"cache holds at most max_len={self.cache.max_len}")
        blocks = -(-seq.max_positions // self.cache.block_size)
        if blocks > self.cache.allocator.num_blocks:
            raise ValueError(f"the sequence can need {blocks} KV blocks; the pool has only "
                             f"num_blocks={self.cache.allocator.num_blocks}")
        seq.status = "waiting"
        self.waiting.append(seq)

    def finish(self, seq: Seq) -> None:
        """A running or waiting sequence is done (finished or cancelled): free its blocks now."""
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq.id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = "finished"

    def preempt(self, seq: Seq) -> None:
        """Take a running sequence out: free its blocks, forget what it computed (it will be
        recomputed: prompt and outputs so far), and put it at the FRONT of the queue."""
        self.running.remove(seq)
        self.cache.free(seq.id)
        seq.num_computed = 0
        seq.status = "waiting"
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the policy --------------------------------------------------------------------------

    def choose_victim(self) -> Seq:
        """The sequence to preempt when the pool is short: the newest running one (of equal
        arrivals, the one admitted last)."""
        return sorted(self.running, key=lambda s: s.arrival)[-1]

    @staticmethod
    def decodes(seq: Seq) -> bool:
        """A running sequence past its prompt with tokens to feed: one it sampled (a decode),
        or a run its grammar forced after it (day 19: fed in one pass, like a short prefill
        chunk). A sequence recomputing after preemption counts once its prompt is in."""
        return seq.num_pending >= 1 and seq.num_computed >= len(seq.prompt_ids)

    def cached_prefix(self, seq: Seq) -> list[int]:
        """The cached blocks `seq` can start on: full blocks of its tokens, leaving at least
        its last token to compute (empty without prefix caching)."""
        if not seq.cache_prefix or not getattr(self.cache, "prefix_caching", False):
            return []
        return self.cache.match(seq.tokens(0, seq.num_tokens),
                                (seq.num_tokens - 1) // self.cache.block_size)

    def can_admit(self, seq: Seq, budget_left: int) -> bool:
        """A free slot, budget left, and free blocks for every pending token of `seq` past
        the cached blocks it would start on (a parked one leaves the free pool when taken)."""
        prefix = self.cached_prefix(seq)
        parked = sum(block in self.cache.allocator.parked for block in prefix) if prefix else 0
        needed = blocks_for(self.cache, seq.num_tokens) - len(prefix) + parked
        return (len(self.running) < self.max_running and budget_left > 0
                and needed <= self.cache.allocator.num_free)

    def schedule(self) -> StepPlan:
        """Decide the next step (see the module docstring); reserves the blocks it needs."""
        plan = StepPlan([], [], [])
        budget = self.token_budget
        # 1. decodes (and forced runs), oldest first; make room by preempting the newest
        decoding = [seq for seq in sorted(self.running, key=lambda s: s.arrival)
                    if self.decodes(seq)]
        for index, seq in enumerate(decoding):
            if seq.status != "running" or budget == 0:
                continue
            # a forced run takes what the decodes after it leave (each keeps its one token);
            # a plain decode takes its one token (counting the others would cost O(n^2))
            n = 1
            if seq.num_pending > 1:
                later = sum(s.status == "running" for s in decoding[index + 1:])
                n = max(1, min(seq.num_pending, budget - later))
            while self.cache.blocks_needed(seq.id, n) > self.cache.allocator.num_free:
                victim = self.choose_victim()
                self.preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != "running":
                continue
            self.cache.reserve(seq.id, n)
            plan.scheduled.append(Scheduled(seq, seq.num_computed, n))
            budget -= n
        # 2. prefill chunks of running sequences (their blocks were reserved on admission)
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.num_pending >= 1 and budget > 0 and not self.decodes(seq):
                n = min(seq.num_pending, budget)
                plan.scheduled.append(Scheduled(seq, seq.num_computed, n))
                budget -= n
        # 3. admission, first come first served, no skipping
        while self.waiting and self.can_admit(self.waiting[0], budget):
            seq = self.waiting.popleft()
            prefix = self.cached_prefix(seq)
            if prefix:
                self.cache.add(seq.id, prefix=prefix)
            else:
                self.cache.add(seq.id)
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += len(prefix) * self.cache.block_size
            seq.num_computed = len(prefix) * self.cache.block_size
            self.cache.reserve(seq.id, seq.num_pending)
            seq.status = "running"
            self.running.append(seq)
            plan.admitted.append(seq)
            n = min(seq.num_pending, budget)
            plan.scheduled.append(Scheduled(seq, seq.num_computed, n))
            budget -= n
        return plan

    def complete(self, scheduled: Sequence[Scheduled]) -> None:
        """The step ran: the fed tokens now have keys and values in the cache."""
        for item in scheduled:
            item.seq.num_computed += item.n
            self.cache.lengths[item.seq.id] += item.n
            if getattr(self.cache, "prefix_caching", False) and self.cache.needs_commit(
                    item.seq.id):
                self.cache.commit(item.seq.id, item.seq.tokens(0, item.seq.num_computed))
            if getattr(self.cache, "window", 0):        # day 21: blocks out of every window
                self.cache.drop_out_of_window(item.seq.id)


def blocks_for(cache, n_tokens: int) -> int:
    """Blocks a new sequence of n_tokens positions takes from the pool."""
    return -(-n_tokens // cache.block_size)
