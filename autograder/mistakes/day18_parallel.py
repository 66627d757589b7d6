"""Day 18 mistakes: each must lose its exercise's points."""

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    # ------------------------------------------------------------ column-parallel shard
    Mistake("column_shard", "slices the input columns instead of the output rows", """
def column_shard(weight, rank, world_size):
    n = weight.shape[1] // world_size
    return weight[:, rank * n:(rank + 1) * n]
"""),
    Mistake("column_shard", "interleaves rows (rank::p): splits every head across ranks", """
def column_shard(weight, rank, world_size):
    if weight.shape[0] % world_size:
        raise ValueError("world_size must divide the rows")
    return weight[rank::world_size]
"""),
    Mistake("column_shard", "rounds up instead of refusing an uneven split", """
def column_shard(weight, rank, world_size):
    n = -(-weight.shape[0] // world_size)
    return weight[rank * n:(rank + 1) * n]
"""),
    Mistake("column_shard", "its ValueError does not say which world_size is wrong", """
def column_shard(weight, rank, world_size):
    out = weight.shape[0]
    if out % world_size:
        raise ValueError("cannot split the rows evenly")
    n = out // world_size
    return weight[rank * n:(rank + 1) * n]
""", says="names neither world_size"),
    # ------------------------------------------------------------ the split MLP
    Mistake("tp_mlp", "all-reduces after the column-parallel layer instead of the row-parallel one",
            """
def tp_mlp(x, shards, all_reduce):
    hidden = all_reduce([F.silu(x @ w1.T) * (x @ w3.T) for w1, w3, _ in shards])
    return [h @ w2.T for h, (_, _, w2) in zip(hidden, shards)]
""", says="the all-reduce comes after w2"),
    Mistake("tp_mlp", "forgets the all-reduce: each rank keeps its partial sum", """
def tp_mlp(x, shards, all_reduce):
    return [(F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T for w1, w3, w2 in shards]
""", says="never called all_reduce"),
    Mistake("tp_mlp", "all-reduces twice (gate/up outputs and the down projection)", """
def tp_mlp(x, shards, all_reduce):
    partials = [(F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T for w1, w3, w2 in shards]
    all_reduce([F.silu(x @ w1.T) for w1, _, _ in shards])
    return all_reduce(partials)
"""),
    Mistake("tp_mlp", "applies SiLU after the all-reduce (to the sum)", """
def tp_mlp(x, shards, all_reduce):
    partials = [((x @ w1.T) * (x @ w3.T)) @ w2.T for w1, w3, w2 in shards]
    return [F.silu(y) for y in all_reduce(partials)]
""", says="nothing is applied after it"),
    # ------------------------------------------------------------ heads over ranks
    Mistake("heads_for_rank", "shards the KV heads unevenly: round-robin, not the ones its "
            "queries read", """
def heads_for_rank(n_heads, n_kv_heads, rank, world_size):
    if n_heads % world_size:
        raise ValueError("world_size must divide n_heads")
    per_rank = n_heads // world_size
    query = list(range(rank * per_rank, (rank + 1) * per_rank))
    if n_kv_heads % world_size == 0:
        return query, list(range(rank, n_kv_heads, world_size))
    if world_size % n_kv_heads == 0:
        return query, [query[0] // (n_heads // n_kv_heads)]
    raise ValueError("uneven KV heads")
"""),
    Mistake("heads_for_rank", "gives every rank all KV heads when there are fewer than ranks", """
def heads_for_rank(n_heads, n_kv_heads, rank, world_size):
    if n_heads % world_size:
        raise ValueError("world_size must divide n_heads")
    per_rank = n_heads // world_size
    query = list(range(rank * per_rank, (rank + 1) * per_rank))
    if n_kv_heads % world_size == 0:
        kv = n_kv_heads // world_size
        return query, list(range(rank * kv, (rank + 1) * kv))
    if world_size % n_kv_heads == 0:
        return query, list(range(n_kv_heads))
    raise ValueError("uneven KV heads")
"""),
    Mistake("heads_for_rank", "splits the KV heads in floor-sized blocks without refusing", """
def heads_for_rank(n_heads, n_kv_heads, rank, world_size):
    if n_heads % world_size:
        raise ValueError("world_size must divide n_heads")
    per_rank = n_heads // world_size
    query = list(range(rank * per_rank, (rank + 1) * per_rank))
    first = query[0] // (n_heads // n_kv_heads)
    last = query[-1] // (n_heads // n_kv_heads)
    return query, list(range(first, last + 1))
"""),
    # ------------------------------------------------------------ vocabulary-parallel logits
    Mistake("gather_logits", "concatenates in arrival order, not rank order", """
def gather_logits(pieces, vocab_size):
    return torch.cat([piece for _, piece in pieces], dim=-1)[..., :vocab_size]
"""),
    Mistake("gather_logits", "keeps the padding (returns ceil(V / p) * p logits)", """
def gather_logits(pieces, vocab_size):
    ordered = [piece for _, piece in sorted(pieces, key=lambda item: item[0])]
    return torch.cat(ordered, dim=-1)
""", says="the padding is still there"),
    Mistake("gather_logits", "cuts the padding with [..., :-pad]: empty when there is none", """
def gather_logits(pieces, vocab_size):
    ordered = [piece for _, piece in sorted(pieces, key=lambda item: item[0])]
    logits = torch.cat(ordered, dim=-1)
    pad = logits.shape[-1] - vocab_size
    return logits[..., :-pad]
""", says="[..., :-pad]"),
    Mistake("gather_logits", "cuts the padding off the front", """
def gather_logits(pieces, vocab_size):
    ordered = [piece for _, piece in sorted(pieces, key=lambda item: item[0])]
    return torch.cat(ordered, dim=-1)[..., -vocab_size:]
"""),
    # ------------------------------------------------------------ sampling on every rank
    Mistake("sample_on_ranks", "each rank seeds a generator of its own (seed + rank)", """
def sample_on_ranks(logits, seed, world_size):
    probs = torch.softmax(logits, dim=-1)
    return [int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed + r)))
            for r in range(world_size)]
""", says="seed + rank"),
    Mistake("sample_on_ranks", "draws from torch's global generator", """
def sample_on_ranks(logits, seed, world_size):
    probs = torch.softmax(logits, dim=-1)
    return [int(torch.multinomial(probs, 1)) for _ in range(world_size)]
""", says="torch's global generator"),
    Mistake("sample_on_ranks", "one generator shared by the ranks' draws in turn", """
def sample_on_ranks(logits, seed, world_size):
    probs = torch.softmax(logits, dim=-1)
    g = torch.Generator().manual_seed(seed)
    return [int(torch.multinomial(probs, 1, generator=g)) for _ in range(world_size)]
""", says="one generator shared by the ranks"),
    # ------------------------------------------------------------ ring all-reduce cost
    Mistake("ring_allreduce_time", "forgets the factor 2 (counts the reduce-scatter only)", """
def ring_allreduce_time(nbytes, world_size, bandwidth, latency):
    if world_size == 1:
        return 0.0
    return latency + (world_size - 1) / world_size * nbytes / bandwidth
"""),
    Mistake("ring_allreduce_time", "sends the whole tensor at every step: 2 (p - 1) x bytes", """
def ring_allreduce_time(nbytes, world_size, bandwidth, latency):
    if world_size == 1:
        return 0.0
    return latency + 2 * (world_size - 1) * nbytes / bandwidth
"""),
    Mistake("ring_allreduce_time", "pays the latency at each of the ring's 2 (p - 1) steps", """
def ring_allreduce_time(nbytes, world_size, bandwidth, latency):
    if world_size == 1:
        return 0.0
    steps = 2 * (world_size - 1)
    return steps * latency + steps / world_size * nbytes / bandwidth
""", says="ONCE per all-reduce"),
    Mistake("ring_allreduce_time", "charges the latency with one rank", """
def ring_allreduce_time(nbytes, world_size, bandwidth, latency):
    return latency + 2 * (world_size - 1) / world_size * nbytes / bandwidth
"""),
    # ------------------------------------------------------------ pipeline bubble
    Mistake("bubble", "divides by the micro-batches only", """
def bubble(stages, micro_batches):
    return (stages - 1) / micro_batches
"""),
    Mistake("bubble", "counts m + p slots", """
def bubble(stages, micro_batches):
    return (stages - 1) / (micro_batches + stages)
"""),
    # ------------------------------------------------------------ self-checks
    Mistake("q1", "all-reduces the column-parallel outputs", 'answer_q1 = "A"\n'),
    Mistake("q2", "counts float32 bytes", "answer_q2 = 576 * 4\n"),
    Mistake("q2", "gives what the ring sends, 2 (p - 1) / p of the tensor, not its size",
            "answer_q2 = 2 * (3 - 1) / 3 * 576 * 2\n"),
    Mistake("q3", "thinks a KV head can be split", 'answer_q3 = "A"\n'),
]

EQUIVALENT_MUTANTS = {
    "heads_for_rank: return query, [query[0] // (n_heads // n_kv_heads)] => return query, "
    "[query[-1] // (n_heads // n_kv_heads)]":
        "this branch runs only when world_size is a multiple of n_kv_heads, so a rank's query "
        "heads all lie in one KV group: the first and the last read the same KV head",
    "gather_logits: ordered = [piece for _, piece in sorted(pieces, key=lambda item: item[0])] "
    "=> ordered = [piece for _, piece in sorted(pieces)]":
        "ranks are distinct, so sorting the (rank, tensor) pairs compares ranks only",
    "sample_on_ranks: probs = torch.softmax(logits, dim=-1) => probs = torch.softmax(logits, "
    "dim=0)":
        "logits has shape (V,): dims -1 and 0 are the same dimension",
}

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('column_shard', 'chunk', """
def column_shard(weight, rank, world_size):
    if weight.shape[0] % world_size != 0:
        raise ValueError(f"world_size={world_size} does not divide {weight.shape[0]} rows")
    return weight.chunk(world_size, dim=0)[rank]
"""),
    Alternative('heads_for_rank', 'derive kv from query heads (set)', """
def heads_for_rank(n_heads, n_kv_heads, rank, world_size):
    if n_heads % world_size or (n_kv_heads % world_size and world_size % n_kv_heads):
        raise ValueError(f"world_size {world_size} does not fit {n_heads} heads / {n_kv_heads} KV heads")
    per = n_heads // world_size
    group = n_heads // n_kv_heads
    qh = list(range(rank * per, rank * per + per))
    kv = sorted({h // group for h in qh})
    return qh, kv
"""),
    Alternative('gather_logits', 'sorted tuples, compute pad', """
def gather_logits(pieces, vocab_size):
    slices = [t for _, t in sorted(pieces, key=lambda rt: rt[0])]
    full = torch.cat(slices, -1)
    pad = full.shape[-1] - vocab_size
    return full[..., :full.shape[-1] - pad]
"""),
    Alternative('sample_on_ranks', 'draw once then replicate (same seeded draw)', """
def sample_on_ranks(logits, seed, world_size):
    def one_rank():
        g = torch.Generator().manual_seed(seed)
        return int(torch.multinomial(F.softmax(logits, -1), num_samples=1, replacement=True, generator=g)[0])
    return [one_rank() for _ in range(world_size)]
"""),
    Alternative('ring_allreduce_time', '<= 1 int zero', """
def ring_allreduce_time(nbytes, world_size, bandwidth, latency):
    if world_size <= 1:
        return 0
    sent = 2 * (world_size - 1) * nbytes / world_size
    return latency + sent / bandwidth
"""),
    Alternative('bubble', 'slots', """
def bubble(stages, micro_batches):
    slots = micro_batches + stages - 1
    return 1 - micro_batches / slots
"""),
    Alternative('q2', 'float', """
answer_q2 = 576 * 2.0
"""),
    Alternative('tp_mlp', 'float64 partials cast back', """
def tp_mlp(x, shards, all_reduce):
    parts = [((F.silu(x.double() @ a.double().T) * (x.double() @ b.double().T)) @ c.double().T).to(x.dtype)
             for a, b, c in shards]
    return list(all_reduce(parts))
"""),
    # self-check numbers from numpy / torch (testing.is_number); capitalised messages (str(err).lower())
    Alternative('q2', 'a NumPy int64', '''
# Set answer_q2 to a number.
import numpy as np
answer_q2 = np.int64(576) * 2
'''),
    Alternative('column_shard', 'a message that starts with a capital (World_size) and omits the value', '''
def column_shard(weight, rank, world_size):
    """Rank `rank`'s block of rows of weight (out, in): (out / world_size, in)."""
    out = weight.shape[0]
    if out % world_size:
        raise ValueError("World_size must divide the output features")
    n = out // world_size
    return weight[rank * n:(rank + 1) * n]
'''),
]
