"""Day 17 mistakes: each must lose its exercise's points."""

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    # ------------------------------------------------------------ admission
    Mistake("can_admit", "admits without checking for free blocks", """
def can_admit(scheduler, seq, budget_left):
    return len(scheduler.running) < scheduler.max_running and budget_left > 0
"""),
    Mistake("can_admit", "counts only the blocks of the first chunk it feeds this step", """
def can_admit(scheduler, seq, budget_left):
    if len(scheduler.running) >= scheduler.max_running or budget_left <= 0:
        return False
    first_chunk = min(seq.num_pending, budget_left)
    return blocks_for(scheduler.cache, first_chunk) <= scheduler.cache.allocator.num_free
"""),
    Mistake("can_admit", "counts the prompt, not the pending tokens (a preempted sequence's "
            "outputs are forgotten)", """
def can_admit(scheduler, seq, budget_left):
    if len(scheduler.running) >= scheduler.max_running or budget_left <= 0:
        return False
    return blocks_for(scheduler.cache, len(seq.prompt_ids)) <= scheduler.cache.allocator.num_free
"""),
    Mistake("can_admit", "floor division: a partly filled last block is not counted", """
def can_admit(scheduler, seq, budget_left):
    if len(scheduler.running) >= scheduler.max_running or budget_left <= 0:
        return False
    blocks = seq.num_pending // scheduler.cache.block_size
    return blocks <= scheduler.cache.allocator.num_free
"""),
    Mistake("can_admit", "demands a spare block (an exact fit is refused)", """
def can_admit(scheduler, seq, budget_left):
    if len(scheduler.running) >= scheduler.max_running or budget_left <= 0:
        return False
    return blocks_for(scheduler.cache, seq.num_pending) < scheduler.cache.allocator.num_free
"""),
    Mistake("can_admit", "ignores max_running", """
def can_admit(scheduler, seq, budget_left):
    if budget_left <= 0:
        return False
    return blocks_for(scheduler.cache, seq.num_pending) <= scheduler.cache.allocator.num_free
"""),
    Mistake("can_admit", "ignores the budget", """
def can_admit(scheduler, seq, budget_left):
    if len(scheduler.running) >= scheduler.max_running:
        return False
    return blocks_for(scheduler.cache, seq.num_pending) <= scheduler.cache.allocator.num_free
"""),
    # ------------------------------------------------------------ the token budget
    Mistake("step_shares", "prefill chunks first: a long prompt starves the decodes", """
def step_shares(running, budget):
    shares = []
    for seq in running:
        if seq.num_pending > 1 and budget > 0:
            n = min(seq.num_pending, budget)
            shares.append((seq, seq.num_computed, n))
            budget -= n
    for seq in running:
        if seq.num_pending == 1 and budget > 0:
            shares.append((seq, seq.num_computed, 1))
            budget -= 1
    return shares
"""),
    Mistake("step_shares", "one pass in batch order: decodes and prefills take turns", """
def step_shares(running, budget):
    shares = []
    for seq in running:
        if budget > 0:
            n = min(seq.num_pending, budget)
            shares.append((seq, seq.num_computed, n))
            budget -= n
    return shares
"""),
    Mistake("step_shares", "a prefill is fed whole, ignoring the budget", """
def step_shares(running, budget):
    shares = []
    for seq in running:
        if seq.num_pending == 1 and budget > 0:
            shares.append((seq, seq.num_computed, 1))
            budget -= 1
    for seq in running:
        if seq.num_pending > 1 and budget > 0:
            shares.append((seq, seq.num_computed, seq.num_pending))
            budget -= seq.num_pending
    return shares
"""),
    Mistake("step_shares", "every chunk starts at 0 instead of num_computed", """
def step_shares(running, budget):
    shares = []
    for seq in running:
        if seq.num_pending == 1 and budget > 0:
            shares.append((seq, seq.num_computed, 1))
            budget -= 1
    for seq in running:
        if seq.num_pending > 1 and budget > 0:
            n = min(seq.num_pending, budget)
            shares.append((seq, 0, n))
            budget -= n
    return shares
"""),
    Mistake("step_shares", "a chunk starts at len(prompt) - pending: right for a prompt, negative "
            "for a preempted sequence with outputs", """
def step_shares(running, budget):
    shares = []
    for seq in running:
        if seq.num_pending == 1 and budget > 0:
            shares.append((seq, seq.num_computed, 1))
            budget -= 1
    for seq in running:
        if seq.num_pending > 1 and budget > 0:
            n = min(seq.num_pending, budget)
            shares.append((seq, len(seq.prompt_ids) - seq.num_pending, n))
            budget -= n
    return shares
""", says="wherever the prompt ends"),
    Mistake("step_shares", "decodes do not count against the budget", """
def step_shares(running, budget):
    shares = []
    for seq in running:
        if seq.num_pending == 1:
            shares.append((seq, seq.num_computed, 1))
    for seq in running:
        if seq.num_pending > 1 and budget > 0:
            n = min(seq.num_pending, budget)
            shares.append((seq, seq.num_computed, n))
            budget -= n
    return shares
"""),
    Mistake("step_shares", "hands out zero-token shares once the budget is spent", """
def step_shares(running, budget):
    shares = []
    for seq in running:
        if seq.num_pending == 1:
            n = min(1, budget)
            shares.append((seq, seq.num_computed, n))
            budget -= n
    for seq in running:
        if seq.num_pending > 1:
            n = min(seq.num_pending, budget)
            shares.append((seq, seq.num_computed, n))
            budget -= n
    return shares
"""),
    # ------------------------------------------------------------ the victim
    Mistake("choose_victim", "preempts the oldest running sequence", """
def choose_victim(scheduler):
    return sorted(scheduler.running, key=lambda seq: seq.arrival)[0]
"""),
    Mistake("choose_victim", "picks the request that just arrived in the waiting queue", """
def choose_victim(scheduler):
    if scheduler.waiting:
        return scheduler.waiting[-1]
    return scheduler.running[-1]
"""),
    Mistake("choose_victim", "preempts the longest sequence (the one holding most blocks)", """
def choose_victim(scheduler):
    return max(scheduler.running, key=lambda seq: seq.num_tokens)
"""),
    Mistake("choose_victim", "the last in the running list (not the newest after a readmission)",
            """
def choose_victim(scheduler):
    return scheduler.running[-1]
"""),
    Mistake("choose_victim", "of equal arrivals, the one admitted first", """
def choose_victim(scheduler):
    return max(scheduler.running, key=lambda seq: seq.arrival)
"""),
    Mistake("choose_victim", "breaks a tie of arrivals by id", """
def choose_victim(scheduler):
    return max(scheduler.running, key=lambda seq: (seq.arrival, seq.id))
""", says="neither the id"),
    Mistake("choose_victim", "breaks a tie of arrivals by length (the longest)", """
def choose_victim(scheduler):
    return sorted(scheduler.running, key=lambda seq: (seq.arrival, seq.num_tokens))[-1]
""", says="nor the length"),
    Mistake("choose_victim", "breaks a tie of arrivals by the most computed: may preempt a "
            "sequence the step already fed", """
def choose_victim(scheduler):
    return sorted(scheduler.running, key=lambda seq: (seq.arrival, seq.num_computed))[-1]
""", says="already scheduled"),
    Mistake("choose_victim", "breaks a tie of arrivals by the fewest pending tokens", """
def choose_victim(scheduler):
    return sorted(scheduler.running, key=lambda seq: (seq.arrival, -seq.num_pending))[-1]
""", says="equal arrivals"),
    # ------------------------------------------------------------ preemption
    Mistake("preempt", "sends the preempted sequence to the back of the queue", """
def preempt(scheduler, seq):
    scheduler.running.remove(seq)
    scheduler.cache.free(seq.id)
    seq.num_computed = 0
    seq.status = "waiting"
    seq.preemptions += 1
    scheduler.num_preemptions += 1
    scheduler.waiting.append(seq)
""", says="at the FRONT of the queue"),
    Mistake("preempt", "leaves the preempted sequence in the running list", """
def preempt(scheduler, seq):
    scheduler.cache.free(seq.id)
    seq.num_computed = 0
    seq.status = "waiting"
    seq.preemptions += 1
    scheduler.num_preemptions += 1
    scheduler.waiting.appendleft(seq)
""", says="scheduler.running.remove(seq)"),
    Mistake("preempt", "never frees the victim's blocks", """
def preempt(scheduler, seq):
    scheduler.running.remove(seq)
    seq.num_computed = 0
    seq.status = "waiting"
    seq.preemptions += 1
    scheduler.num_preemptions += 1
    scheduler.waiting.appendleft(seq)
"""),
    Mistake("preempt", "does not reset num_computed (it resumes as if its keys were kept)", """
def preempt(scheduler, seq):
    scheduler.running.remove(seq)
    scheduler.cache.free(seq.id)
    seq.status = "waiting"
    seq.preemptions += 1
    scheduler.num_preemptions += 1
    scheduler.waiting.appendleft(seq)
"""),
    Mistake("preempt", "drops the outputs it already produced", """
def preempt(scheduler, seq):
    scheduler.running.remove(seq)
    scheduler.cache.free(seq.id)
    seq.num_computed = 0
    seq.output_ids = []
    seq.status = "waiting"
    seq.preemptions += 1
    scheduler.num_preemptions += 1
    scheduler.waiting.appendleft(seq)
"""),
    Mistake("preempt", "does not count the preemption", """
def preempt(scheduler, seq):
    scheduler.running.remove(seq)
    scheduler.cache.free(seq.id)
    seq.num_computed = 0
    seq.status = "waiting"
    scheduler.waiting.appendleft(seq)
"""),
    # ------------------------------------------------------------ finishing
    Mistake("finish", "never releases a finished sequence's blocks", """
def finish(scheduler, seq):
    if seq in scheduler.running:
        scheduler.running.remove(seq)
    elif seq in scheduler.waiting:
        scheduler.waiting.remove(seq)
    seq.status = "finished"
"""),
    Mistake("finish", "frees the blocks but leaves the sequence in the batch", """
def finish(scheduler, seq):
    if seq in scheduler.running:
        scheduler.cache.free(seq.id)
    elif seq in scheduler.waiting:
        scheduler.waiting.remove(seq)
    seq.status = "finished"
"""),
    Mistake("finish", "forgets a cancelled request that is still waiting", """
def finish(scheduler, seq):
    if seq in scheduler.running:
        scheduler.running.remove(seq)
        scheduler.cache.free(seq.id)
    seq.status = "finished"
"""),
    Mistake("finish", "frees blocks for a waiting sequence too (it holds none)", """
def finish(scheduler, seq):
    if seq in scheduler.running:
        scheduler.running.remove(seq)
    elif seq in scheduler.waiting:
        scheduler.waiting.remove(seq)
    scheduler.cache.free(seq.id)
    seq.status = "finished"
"""),
    # ------------------------------------------------------------ the runner's mask
    Mistake("step_mask", "ignores the start: every chunk masked as if it began at position 0", """
def step_mask(starts, counts, n_keys):
    count = torch.tensor(counts)[:, None, None]
    j = torch.arange(max(counts))[None, :, None]
    k = torch.arange(n_keys)[None, None, :]
    return torch.where(j < count, k <= j, k == 0).expand(len(starts), -1, -1)
"""),
    Mistake("step_mask", "strictly before the query: a token cannot see itself", """
def step_mask(starts, counts, n_keys):
    start = torch.tensor(starts)[:, None, None]
    count = torch.tensor(counts)[:, None, None]
    j = torch.arange(max(counts))[None, :, None]
    k = torch.arange(n_keys)[None, None, :]
    return torch.where(j < count, k < start + j, k == 0)
""", says="and its own key"),
    Mistake("step_mask", "padding queries see no key (their softmax is NaN)", """
def step_mask(starts, counts, n_keys):
    start = torch.tensor(starts)[:, None, None]
    count = torch.tensor(counts)[:, None, None]
    j = torch.arange(max(counts))[None, :, None]
    k = torch.arange(n_keys)[None, None, :]
    return (j < count) & (k <= start + j)
"""),
    Mistake("step_mask", "padding queries treated as real ones", """
def step_mask(starts, counts, n_keys):
    start = torch.tensor(starts)[:, None, None]
    j = torch.arange(max(counts))[None, :, None]
    k = torch.arange(n_keys)[None, None, :]
    return k <= start + j
"""),
    Mistake("step_mask", "keys counted from the step's first token (only this step's keys)", """
def step_mask(starts, counts, n_keys):
    start = torch.tensor(starts)[:, None, None]
    count = torch.tensor(counts)[:, None, None]
    j = torch.arange(max(counts))[None, :, None]
    k = torch.arange(n_keys)[None, None, :]
    return torch.where(j < count, (k >= start) & (k <= start + j), k == 0)
""", says="the keys earlier steps cached"),
    # ------------------------------------------------------------ self-checks
    # ------------------------------------------------------------ prefix caching
    Mistake("block_keys", "keys a block by its own tokens alone: two prefixes share the key", """
block_key = PagedKVCache.block_key


def block_keys(tokens, block_size):
    return [block_key(b"", tokens[i * block_size:(i + 1) * block_size])
            for i in range(len(tokens) // block_size)]
""", keeps=("cached_prefix",)),
    Mistake("block_keys", "keys the partly filled last block too", """
block_key = PagedKVCache.block_key


def block_keys(tokens, block_size):
    keys, key = [], b""
    for i in range(-(-len(tokens) // block_size)):
        key = block_key(key, tokens[i * block_size:(i + 1) * block_size])
        keys.append(key)
    return keys
""", keeps=("cached_prefix",)),
    Mistake("block_keys", "off by one at the block boundaries: each block takes the next one's "
            "first token", """
block_key = PagedKVCache.block_key


def block_keys(tokens, block_size):
    keys, key = [], b""
    for i in range(len(tokens) // block_size):
        key = block_key(key, tokens[i * block_size:(i + 1) * block_size + 1])
        keys.append(key)
    return keys
""", keeps=("cached_prefix",)),
    Mistake("block_keys", "chains over the previous block's tokens instead of its key", """
block_key = PagedKVCache.block_key


def block_keys(tokens, block_size):
    keys, previous = [], []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        keys.append(block_key(bytes(previous), block))
        previous = block
    return keys
""", keeps=("cached_prefix",)),
    Mistake("block_keys", "drops the last full block", """
block_key = PagedKVCache.block_key


def block_keys(tokens, block_size):
    keys, key = [], b""
    for i in range(len(tokens) // block_size - 1):
        key = block_key(key, tokens[i * block_size:(i + 1) * block_size])
        keys.append(key)
    return keys
""", keeps=("cached_prefix",)),
    Mistake("cached_prefix", "reuses the whole prompt, leaving no token to compute", """
def cached_prefix(scheduler, seq):
    size = scheduler.cache.block_size
    blocks = []
    for key in block_keys(seq.tokens(0, seq.num_tokens), size):
        block = scheduler.cache.allocator.block_of.get(key)
        if block is None:
            break
        blocks.append(block)
    return blocks
"""),
    Mistake("cached_prefix", "skips a missing block and keeps looking (a gap in the chain)", """
def cached_prefix(scheduler, seq):
    size = scheduler.cache.block_size
    most = (seq.num_tokens - 1) // size
    blocks = []
    for key in block_keys(seq.tokens(0, seq.num_tokens), size)[:most]:
        block = scheduler.cache.allocator.block_of.get(key)
        if block is not None:
            blocks.append(block)
    return blocks
"""),
    Mistake("cached_prefix", "looks at the prompt only (a preempted sequence's outputs are "
            "forgotten)", """
def cached_prefix(scheduler, seq):
    size = scheduler.cache.block_size
    most = (len(seq.prompt_ids) - 1) // size
    blocks = []
    for key in block_keys(seq.prompt_ids, size)[:most]:
        block = scheduler.cache.allocator.block_of.get(key)
        if block is None:
            break
        blocks.append(block)
    return blocks
"""),
    Mistake("cached_prefix", "always leaves the last full block out, even with tokens after it",
            """
def cached_prefix(scheduler, seq):
    size = scheduler.cache.block_size
    most = seq.num_tokens // size - 1
    blocks = []
    for key in block_keys(seq.tokens(0, seq.num_tokens), size)[:most]:
        block = scheduler.cache.allocator.block_of.get(key)
        if block is None:
            break
        blocks.append(block)
    return blocks
"""),
    Mistake("q1", "thinks the newest holds the most blocks", 'answer_q1 = "A"\n'),
    Mistake("q1", "thinks the newest is always the cheapest to recompute", 'answer_q1 = "C"\n'),
    Mistake("q2", "forgets that the decodes take their share first", "answer_q2 = -(-210 // 64)\n"),
    Mistake("q2", "floor division: the last partial chunk is not a step", "answer_q2 = 210 // 40\n"),
    Mistake("q3", "thinks the batch shares one random generator", 'answer_q3 = "B"\n'),
    Mistake("q4", "counts the last reply token as computed (it is sampled, never fed back)",
            "answer_q4 = 101 - (70 + 26) // 16 * 16\n"),
    Mistake("q4", "thinks only the prompt's blocks are cached, not the reply's",
            "answer_q4 = 101 - 70 // 16 * 16\n"),
    Mistake("q4", "thinks a partly filled block is cached too", "answer_q4 = 101 - 70 - 25\n"),
    Mistake("q4", "thinks nothing is reused from the previous turn", "answer_q4 = 101\n"),
]

EQUIVALENT_MUTANTS: dict[str, str] = {}

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('can_admit', 'manual ceil, early returns', """
import math
def can_admit(scheduler, seq, budget_left):
    if budget_left < 1:
        return False
    if len(scheduler.running) == scheduler.max_running:
        return False
    need = math.ceil(seq.num_pending / scheduler.cache.block_size)
    return need <= scheduler.cache.allocator.num_free
"""),
    Alternative('step_shares', 'one pass, two lists', """
def step_shares(running, budget):
    decodes = [s for s in running if s.num_pending == 1]
    prefills = [s for s in running if s.num_pending > 1]
    out = []
    for s in decodes[:budget]:
        out.append((s, s.num_computed, 1))
    left = budget - len(out)
    for s in prefills:
        if left == 0:
            break
        n = min(s.num_pending, left)
        out.append((s, s.num_computed, n))
        left -= n
    return out
"""),
    Alternative('choose_victim', 'max over reversed', """
def choose_victim(scheduler):
    return max(reversed(scheduler.running), key=lambda s: s.arrival)
"""),
    Alternative('preempt', 'index pop, rotate', """
def preempt(scheduler, seq):
    scheduler.running.pop(scheduler.running.index(seq))
    scheduler.cache.free(seq.id)
    seq.num_computed, seq.status = 0, "waiting"
    seq.preemptions = seq.preemptions + 1
    scheduler.num_preemptions = scheduler.num_preemptions + 1
    scheduler.waiting.append(seq)
    scheduler.waiting.rotate(1)
"""),
    Alternative('step_mask', 'logical ops', """
def step_mask(starts, counts, n_keys):
    st = torch.as_tensor(starts).view(-1, 1, 1)
    ct = torch.as_tensor(counts).view(-1, 1, 1)
    j = torch.arange(max(counts)).view(1, -1, 1)
    k = torch.arange(n_keys).view(1, 1, -1)
    real = j < ct
    return (real & (k <= st + j)) | (~real & (k == 0))
"""),
    Alternative('block_keys', 'range with step, tuple slices', """
def block_keys(tokens, block_size):
    out, prev = [], b""
    for s in range(0, len(tokens) - block_size + 1, block_size):
        prev = block_key(prev, tuple(tokens[s:s + block_size]))
        out.append(prev)
    return out
"""),
    Alternative('q2', 'float', """
answer_q2 = 6.0
"""),
    Alternative('finish', 'by status', """
def finish(scheduler, seq):
    if seq.status == "running":
        scheduler.running.remove(seq)
        scheduler.cache.free(seq.id)
    elif seq.status == "waiting":
        scheduler.waiting.remove(seq)
    seq.status = "finished"
"""),
    # self-check numbers from numpy / torch (testing.is_number); capitalised messages (str(err).lower())
    Alternative('q2', 'a NumPy int64 from np.ceil', '''
# Set answer_q2 to a number.
import numpy as np
answer_q2 = np.int64(np.ceil(210 / (64 - 24)))
'''),
    Alternative('q4', 'a 0-d torch tensor', '''
# Set answer_q4 to a number.
import torch
answer_q4 = torch.tensor(21)
'''),
]
