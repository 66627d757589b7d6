"""Day 13 mistakes: each must lose its exercise's points."""

from autograder.mistakes import Alternative, Mistake

_PAD_CHECKS = """
def left_pad_batch(prompts, pad_id=0):
    if len(prompts) == 0:
        raise ValueError("prompts must not be empty")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
"""

_MASK_HEAD = """
def padded_causal_mask(key_mask, n_queries):
    S = key_mask.shape[1]
    query_pos = torch.arange(S - n_queries, S)[:, None]
    key_pos = torch.arange(S)[None, :]
"""

_ADMIT_HEAD = """
def admit_requests(policy, n_waiting, n_running, max_batch, more_coming):
    if policy not in ("static", "continuous"):
        raise ValueError(f"unknown policy {policy!r}")
"""

MISTAKES = [
    # ---------------------------------------------------------------- left padding
    Mistake("left_pad_batch", "pads on the right (prompts left-aligned)", _PAD_CHECKS + """
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = torch.tensor(p, dtype=torch.long)
        mask[row, :len(p)] = True
    return ids, mask
"""),
    Mistake("left_pad_batch", "mask marks the pads instead of the real tokens", _PAD_CHECKS + """
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.ones(len(prompts), width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = False
    return ids, mask
"""),
    Mistake("left_pad_batch", "always pads with 0, ignoring pad_id", _PAD_CHECKS + """
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = True
    return ids, mask
"""),
    Mistake("left_pad_batch", "no checks: an empty prompt slips through", """
def left_pad_batch(prompts, pad_id=0):
    width = max([len(p) for p in prompts] + [1])
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        if len(p):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = True
    return ids, mask
"""),
    Mistake("left_pad_batch", "mask as 0/1 integers instead of bool", _PAD_CHECKS + """
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask
"""),
    Mistake("left_pad_batch", "mask computed as ids != pad_id (a real token equal to pad_id "
            "is taken for a pad)", _PAD_CHECKS + """
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    return ids, ids != pad_id
""", says="the pad id itself"),
    # ---------------------------------------------------------------- positions
    Mistake("positions_from_mask", "positions counted from the padded start (the column)", """
def positions_from_mask(mask):
    return torch.arange(mask.shape[1]).expand(mask.shape[0], -1).clone()
"""),
    Mistake("positions_from_mask", "counts from 1 (cumsum without the - 1)", """
def positions_from_mask(mask):
    return mask.long().cumsum(dim=1)
"""),
    Mistake("positions_from_mask", "pads get -1 (no clamp)", """
def positions_from_mask(mask):
    return mask.long().cumsum(dim=1) - 1
"""),
    Mistake("positions_from_mask", "a pad after the real tokens gets the last real position "
            "(the clamp only reaches pads before them)", """
def positions_from_mask(mask):
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)
"""),
    Mistake("positions_from_mask", "cumsum over the batch dimension", """
def positions_from_mask(mask):
    return (mask.long().cumsum(dim=0) - 1).clamp(min=0)
"""),
    # ---------------------------------------------------------------- the mask
    Mistake("padded_causal_mask", "the padding mask also hides a pad query's own key (NaN rows)",
            _MASK_HEAD + """
    causal = key_pos <= query_pos
    return causal[None] & key_mask[:, None, :]
"""),
    Mistake("padded_causal_mask", "forgets the causal part", _MASK_HEAD + """
    own = key_pos == query_pos
    return (key_mask[:, None, :] | own[None]).expand(-1, n_queries, -1).clone()
"""),
    Mistake("padded_causal_mask", "causal mask aligned to the top left (j <= i)", _MASK_HEAD + """
    causal = key_pos <= torch.arange(n_queries)[:, None]
    own = key_pos == query_pos
    return causal[None] & (key_mask[:, None, :] | own[None])
"""),
    Mistake("padded_causal_mask", "forgets the padding mask (causal only)", _MASK_HEAD + """
    causal = key_pos <= query_pos
    return causal[None].expand(key_mask.shape[0], -1, -1).clone()
"""),
    Mistake("padded_causal_mask", "strictly causal: a query cannot see itself", _MASK_HEAD + """
    causal = key_pos < query_pos
    own = key_pos == query_pos
    return causal[None] & (key_mask[:, None, :] | own[None])
"""),
    Mistake("padded_causal_mask", "own-key term aligned to the top left (key i, not "
            "S - n_queries + i)", _MASK_HEAD + """
    causal = key_pos <= query_pos
    own = key_pos == torch.arange(n_queries)[:, None]
    return causal[None] & (key_mask[:, None, :] | own[None])
""", says="its own key is key 3"),
    # ---------------------------------------------------------------- next tokens
    Mistake("next_tokens", "finished rows keep producing their argmax", """
def next_tokens(logits, finished, eos_id, pad_id):
    tokens = logits.argmax(dim=-1)
    return tokens, finished | (tokens == eos_id)
""", says="only rows already finished"),
    Mistake("next_tokens", "forgets rows that finished earlier", """
def next_tokens(logits, finished, eos_id, pad_id):
    tokens = torch.where(finished, torch.full_like(finished, pad_id, dtype=torch.long),
                         logits.argmax(dim=-1))
    return tokens, (tokens == eos_id) & ~finished
"""),
    Mistake("next_tokens", "one row's EOS finishes the whole batch", """
def next_tokens(logits, finished, eos_id, pad_id):
    tokens = torch.where(finished, torch.full_like(finished, pad_id, dtype=torch.long),
                         logits.argmax(dim=-1))
    done = bool((tokens == eos_id).any())
    return tokens, finished | done
""", says="it keeps running"),
    Mistake("next_tokens", "argmax over the batch dimension", """
def next_tokens(logits, finished, eos_id, pad_id):
    tokens = torch.where(finished, torch.full_like(finished, pad_id, dtype=torch.long),
                         logits.argmax(dim=0)[:len(finished)])
    return tokens, finished | (tokens == eos_id)
"""),
    Mistake("next_tokens", "marks finished rows in place", """
def next_tokens(logits, finished, eos_id, pad_id):
    tokens = torch.where(finished, torch.full_like(finished, pad_id, dtype=torch.long),
                         logits.argmax(dim=-1))
    finished |= tokens == eos_id
    return tokens, finished
"""),
    Mistake("next_tokens", "masks the finished rows by editing the caller's logits", """
def next_tokens(logits, finished, eos_id, pad_id):
    logits[finished] = float("-inf")
    logits[finished, pad_id] = 0.0
    tokens = logits.argmax(dim=-1)
    return tokens, finished | (tokens == eos_id)
""", says="the caller's logits changed"),
    # ---------------------------------------------------------------- beam step
    Mistake("beam_step", "ranks candidates by this step's log-prob only (forgets the beam score)",
            """
def beam_step(log_probs, beam_scores, num_beams):
    vocab = log_probs.shape[1]
    _, index = torch.topk(log_probs.flatten(), num_beams)
    scores = (beam_scores[:, None] + log_probs).flatten()[index]
    return index // vocab, index % vocab, scores
"""),
    Mistake("beam_step", "each beam keeps its own best token (no competition between beams)", """
def beam_step(log_probs, beam_scores, num_beams):
    total = beam_scores[:, None] + log_probs
    best, tokens = total.max(dim=1)
    order = torch.argsort(best, descending=True)
    if len(order) < num_beams:
        order = torch.cat([order, order[:1].repeat(num_beams - len(order))])
    order = order[:num_beams]
    return order, tokens[order], best[order]
""", says="one beam may win several times"),
    Mistake("beam_step", "parent and token swapped (index % V is the beam)", """
def beam_step(log_probs, beam_scores, num_beams):
    vocab = log_probs.shape[1]
    scores, index = torch.topk((beam_scores[:, None] + log_probs).flatten(), num_beams)
    return index % vocab, index // vocab, scores
""", says="beam c // V"),
    Mistake("beam_step", "divides by the number of beams instead of the vocabulary", """
def beam_step(log_probs, beam_scores, num_beams):
    K = log_probs.shape[0]
    scores, index = torch.topk((beam_scores[:, None] + log_probs).flatten(), num_beams)
    return index // K, index % K, scores
"""),
    Mistake("beam_step", "returns the step's log-prob instead of the summed score", """
def beam_step(log_probs, beam_scores, num_beams):
    vocab = log_probs.shape[1]
    _, index = torch.topk((beam_scores[:, None] + log_probs).flatten(), num_beams)
    return index // vocab, index % vocab, log_probs.flatten()[index]
"""),
    Mistake("beam_step", "multiplies probabilities (exp, product, log): underflows on long "
            "beams", """
def beam_step(log_probs, beam_scores, num_beams):
    vocab = log_probs.shape[1]
    probs = (beam_scores.exp()[:, None] * log_probs.exp()).flatten()
    p, index = torch.topk(probs, num_beams)
    return index // vocab, index % vocab, p.log()
""", says="underflow"),
    # ---------------------------------------------------------------- reorder
    Mistake("reorder_cache", "the cache is not reordered", """
def reorder_cache(layers, parents):
    return [(k, v) for k, v in layers]
"""),
    Mistake("reorder_cache", "reorders the keys but not the values", """
def reorder_cache(layers, parents):
    return [(k.index_select(0, parents), v) for k, v in layers]
"""),
    Mistake("reorder_cache", "inverse permutation (argsort of the parents)", """
def reorder_cache(layers, parents):
    order = torch.argsort(parents)
    return [(k.index_select(0, order), v.index_select(0, order)) for k, v in layers]
"""),
    Mistake("reorder_cache", "selects along the heads instead of the beams", """
def reorder_cache(layers, parents):
    return [(k.index_select(1, parents), v.index_select(1, parents)) for k, v in layers]
"""),
    Mistake("reorder_cache", "rewrites the caller's list in place and returns it", """
def reorder_cache(layers, parents):
    for i, (k, v) in enumerate(layers):
        layers[i] = (k.index_select(0, parents), v.index_select(0, parents))
    return layers
""", says="leave `layers`"),
    # ---------------------------------------------------------------- admission
    Mistake("admit_requests", "static batching also fills free slots of a running batch",
            _ADMIT_HEAD + """
    if policy == "continuous":
        return min(n_waiting, max_batch - n_running)
    if n_waiting >= max_batch - n_running or not more_coming:
        return min(n_waiting, max_batch - n_running)
    return 0
"""),
    Mistake("admit_requests", "static batching does not wait for a full batch", _ADMIT_HEAD + """
    if policy == "continuous":
        return min(n_waiting, max_batch - n_running)
    if n_running > 0:
        return 0
    return min(n_waiting, max_batch)
"""),
    Mistake("admit_requests", "static batching never runs the last partial batch", _ADMIT_HEAD + """
    if policy == "continuous":
        return min(n_waiting, max_batch - n_running)
    if n_running == 0 and n_waiting >= max_batch:
        return max_batch
    return 0
"""),
    Mistake("admit_requests", "continuous batching ignores the running requests", _ADMIT_HEAD + """
    if policy == "continuous":
        return min(n_waiting, max_batch)
    if n_running > 0:
        return 0
    if n_waiting >= max_batch or not more_coming:
        return min(n_waiting, max_batch)
    return 0
"""),
    Mistake("admit_requests", "unknown policies treated as continuous", """
def admit_requests(policy, n_waiting, n_running, max_batch, more_coming):
    if policy == "static":
        if n_running > 0:
            return 0
        if n_waiting >= max_batch or not more_coming:
            return min(n_waiting, max_batch)
        return 0
    return min(n_waiting, max_batch - n_running)
"""),
    # ---------------------------------------------------------------- self-checks
    Mistake("q1", "thinks RoPE cannot rotate pads", """
answer_q1 = "A"
"""),
    Mistake("q1", "thinks the causal mask needs left padding", """
answer_q1 = "D"
"""),
    Mistake("q2", "intensity B for fp32 (the 16-bit rule)", """
answer_q2 = 16
"""),
    Mistake("q2", "forgets the factor 2 of multiply-add", """
answer_q2 = 4
"""),
    Mistake("q3", "beams share their cache", """
answer_q3 = "A"
"""),
]

_INT_FILL = "an int fill value or a list of ints already gives torch.long (int64) in torch"

EQUIVALENT_MUTANTS = {
    "left_pad_batch: ids = torch.full((len(prompts), width), pad_id, dtype=torch.long) => "
    "ids = torch.full((len(prompts), width), pad_id)": _INT_FILL,
    "left_pad_batch: ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long) => "
    "ids[row, width - len(p):] = torch.tensor(p)": _INT_FILL,
}

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('left_pad_batch', 'pad_sequence flip', """
from torch.nn.utils.rnn import pad_sequence
def left_pad_batch(prompts, pad_id=0):
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt list or empty prompt")
    rev = [torch.tensor(p[::-1], dtype=torch.long) for p in prompts]
    ids = pad_sequence(rev, batch_first=True, padding_value=pad_id).flip(1)
    m = pad_sequence([torch.ones(len(p), dtype=torch.bool) for p in prompts], batch_first=True, padding_value=False).flip(1)
    return ids, m
"""),
    Alternative('positions_from_mask', 'masked_fill', """
def positions_from_mask(mask):
    return (mask.cumsum(-1) - 1).masked_fill(~mask, 0)
"""),
    Alternative('padded_causal_mask', 'tril difference, expand', """
def padded_causal_mask(key_mask, n_queries):
    B, S = key_mask.shape
    causal = torch.ones(n_queries, S, dtype=torch.bool).tril(S - n_queries)
    own = causal & ~torch.ones(n_queries, S, dtype=torch.bool).tril(S - n_queries - 1)
    return causal.expand(B, -1, -1) & (key_mask.unsqueeze(1).expand(B, n_queries, S) | own)
"""),
    Alternative('next_tokens', 'masked_fill, max indices', """
def next_tokens(logits, finished, eos_id, pad_id):
    tokens = torch.max(logits, dim=1).indices.masked_fill(finished, pad_id)
    return tokens, torch.logical_or(finished, tokens.eq(eos_id))
"""),
    Alternative('beam_step', 'unravel_index', """
def beam_step(log_probs, beam_scores, num_beams):
    cand = log_probs + beam_scores.view(-1, 1)
    scores, flat = cand.view(-1).topk(num_beams)
    parents, tokens = torch.unravel_index(flat, cand.shape)
    return parents, tokens, scores
"""),
    Alternative('reorder_cache', 'stack loop', """
def reorder_cache(layers, parents):
    out = []
    for k, v in layers:
        out.append((torch.stack([k[int(i)] for i in parents]), torch.stack([v[int(i)] for i in parents])))
    return out
"""),
    Alternative('q2', 'int', """
answer_q2 = 8
"""),
    # self-check numbers from numpy / torch (testing.is_number); capitalised messages (str(err).lower())
    Alternative('q2', 'a 0-d torch tensor', '''
# Set answer_q2 to a number (FLOP per byte).
import torch
answer_q2 = torch.tensor(2 * 16) / 4
'''),
]
