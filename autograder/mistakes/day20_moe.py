"""Day 20 mistakes: each must lose its exercise's points, and only its own."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

_TOPK = '''
def route_topk(logits, k, renormalize):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts
'''

_DEEPSEEK = '''
def route_deepseek(logits, bias, k, n_group, topk_group, scale):
    scores = {act}
    choice = {choice}
    n, e = choice.shape
    best_two = {group}
    groups = best_two.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(best_two, dtype=torch.bool).scatter(1, groups, True)
    eligible = keep.repeat_interleave(e // n_group, dim=1)
    experts = choice.masked_fill(~eligible, float("-inf")).topk(k, dim=-1).indices
    weights = {weights}.gather(1, experts)
    return {result}, experts
'''


def _deepseek(act="torch.sigmoid(logits.float())", choice="scores + bias",
              group="choice.view(n, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)",
              weights="scores", result="weights / weights.sum(dim=-1, keepdim=True) * scale"):
    return _DEEPSEEK.format(act=act, choice=choice, group=group, weights=weights, result=result)


_DISPATCH = '''
def dispatch(x, weights, experts, w1, w3, w2):
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = {tokens}
    pair_weights = {pair_weights}
    chosen, counts = torch.unique(flat, return_counts=True)
    out = torch.zeros_like(x)
    start = 0
    for e, count in zip(chosen.tolist(), counts.tolist()):
        rows = tokens[start:start + count]
        h = F.silu(x[rows] @ w1[e].T) * (x[rows] @ w3[e].T)
        {scatter}
        start += count
    return out
'''


def _dispatch(tokens="order // k", pair_weights="weights.reshape(-1)[order]",
              scatter="out.index_add_(0, rows, (h @ w2[e].T) * pair_weights[start:start + count, None])"):
    return _DISPATCH.format(tokens=tokens, pair_weights=pair_weights, scatter=scatter)


_DISTINCT = '''
def expected_distinct(n_experts, k, batch):
    if not 1 <= k <= n_experts:
        raise ValueError(f"k must be between 1 and n_experts={{n_experts}}, got {{k}}")
    return {formula}
'''

_KEPT = '''
def kept_pairs(experts, n_experts, capacity):
    taken = [0] * n_experts
    kept = torch.zeros(experts.shape, dtype=torch.bool)
    for n in range(experts.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[n, j])
            kept[n, j] = taken[e] {compare} capacity
            taken[e] += 1
    return kept
'''

_EP = '''
def ep_moe(xs, routes, shards, all_to_all):
    p = len(xs)
    per = shards[0][0].shape[0]
    rows_out, ids_out, plans = [], [], []
    for r in range(p):
        weights, experts = routes[r]
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        sorted_experts = flat[order]
        owner = {owner}
        rows_out.append([xs[r][tokens[owner == q]] for q in range(p)])
        ids_out.append([{local} for q in range(p)])
        plans.append((weights.reshape(-1)[order], tokens, k))
    rows_in, ids_in = all_to_all(rows_out), all_to_all(ids_out)
    results = []
    for q in range(p):
        w1, w3, w2 = shards[q]
        x, ids = torch.cat(rows_in[q]), torch.cat(ids_in[q])
        y = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            mine = ids == e
            h = F.silu(x[mine] @ w1[e].T) * (x[mine] @ w3[e].T)
            y[mine] = h @ w2[e].T
        results.append(list(torch.split(y, [len(t) for t in rows_in[q]])))
    back = all_to_all(results)
    outs = []
    for r in range(p):
        pair_weights, tokens, k = plans[r]
        out = torch.zeros_like(xs[r])
        {combine}
        outs.append(out)
    return outs
'''


def _ep(owner="sorted_experts // per", local="sorted_experts[owner == q] - q * per",
        combine="out.index_add_(0, tokens, torch.cat(back[r]) * pair_weights[:, None])"):
    return _EP.format(owner=owner, local=local, combine=combine)


MISTAKES = [
    # ------------------------------------------------------------ softmax top-k router
    Mistake("route_topk", "a softmax over the k chosen logits only: right when renormalizing, "
            "wrong without", '''
def route_topk(logits, k, renormalize):
    top, experts = torch.topk(logits.float(), k, dim=-1)
    return torch.softmax(top, dim=-1), experts
''', says="sums to less than 1"),
    Mistake("route_topk", "renormalizes always, ignoring renormalize=False",
            _TOPK.replace("    if renormalize:\n        weights = weights /",
                          "    weights = weights /"), says="sums to less than 1"),
    Mistake("route_topk", "never renormalizes", _TOPK.replace("if renormalize:", "if False:"),
            says="sums to 1"),
    Mistake("route_topk", "returns the top-k logits as the weights, with no softmax", '''
def route_topk(logits, k, renormalize):
    weights, experts = torch.topk(logits.float(), k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts
''', says="not the logits themselves"),
    Mistake("route_topk", "returns the experts sorted by id, the weights left in topk's order",
            _TOPK.replace("    return weights, experts",
                          "    return weights, experts.sort(dim=-1).values"),
            says="largest weight first"),
    Mistake("route_topk", "sorts each row's pairs by expert id", _TOPK.replace(
        "    return weights, experts", "    experts, order = experts.sort(dim=-1)\n"
        "    return weights.gather(-1, order), experts"), says="largest weight first"),
    Mistake("route_topk", "computes the softmax in the logits' own (half) precision",
            _TOPK.replace("torch.softmax(logits.float(), dim=-1)",
                          "torch.softmax(logits, dim=-1)"), says="float32"),
    Mistake("route_topk", "the softmax in half precision, converted to float32 afterwards",
            _TOPK.replace("torch.softmax(logits.float(), dim=-1)",
                          "torch.softmax(logits, dim=-1).float()"), says="float32"),
    Mistake("route_topk", "a softmax over the tokens (dim=0) instead of the experts",
            _TOPK.replace("torch.softmax(logits.float(), dim=-1)",
                          "torch.softmax(logits.float(), dim=0)"), says="own row"),
    Mistake("route_topk", "returns the pair swapped, (experts, weights)",
            _TOPK.replace("    return weights, experts", "    return experts, weights"),
            says="experts first"),
    # ------------------------------------------------------------ DeepSeek-V3's router
    Mistake("route_deepseek", "takes the weights from the biased scores",
            _deepseek(weights="choice"), says="without the bias"),
    Mistake("route_deepseek", "ranks a group by its best score alone",
            _deepseek(group="choice.view(n, n_group, e // n_group).max(dim=-1).values"),
            says="two best"),
    Mistake("route_deepseek", "ranks a group by the sum of all its scores",
            _deepseek(group="choice.view(n, n_group, e // n_group).sum(dim=-1)"),
            says="two best"),
    Mistake("route_deepseek", "does not renormalize the chosen scores",
            _deepseek(result="weights * scale"), says="divide the chosen experts' scores"),
    Mistake("route_deepseek", "forgets the scale",
            _deepseek(result="weights / weights.sum(dim=-1, keepdim=True)"),
            says="multiply the weights by scale"),
    Mistake("route_deepseek", "a softmax instead of the sigmoid",
            _deepseek(act="torch.softmax(logits.float(), dim=-1)"), says="sigmoid"),
    Mistake("route_deepseek", "ignores the bias when choosing", _deepseek(choice="scores"),
            says="the bias chooses"),
    # a 0 beats the kept groups' biased scores once a negative bias pushes them below 0
    Mistake("route_deepseek", "masks the dropped groups' experts with 0 (multiplies by the mask), "
            "not -inf", _deepseek().replace(
                'choice.masked_fill(~eligible, float("-inf"))', "(choice * eligible)"),
            says="-inf"),
    # ------------------------------------------------------------ grouped dispatch
    Mistake("dispatch", "never multiplies by the routing weights", _dispatch(
        scatter="out.index_add_(0, rows, h @ w2[e].T)"), says="routing weight"),
    Mistake("dispatch", "applies the routing weights twice", _dispatch(
        scatter="out.index_add_(0, rows, (h @ w2[e].T) * pair_weights[start:start + count, "
                "None] ** 2)"), says="once"),
    Mistake("dispatch", "reads the pair's token as order % k", _dispatch(tokens="order % k"),
            says="p // k"),
    Mistake("dispatch", "index_copy_: a token's k contributions overwrite each other", _dispatch(
        scatter="out.index_copy_(0, rows, (h @ w2[e].T) * pair_weights[start:start + count, "
                "None])"), says="added together"),
    Mistake("dispatch", "assigns the rows (out[rows] = ...) instead of adding them", _dispatch(
        scatter="out[rows] = (h @ w2[e].T) * pair_weights[start:start + count, None]"),
            says="added together"),
    Mistake("dispatch", "leaves the weights in the unsorted order while the pairs are sorted",
            _dispatch(pair_weights="weights.reshape(-1)"), says="sort their weights with them"),
    Mistake("dispatch", "runs every expert on every token and masks by the weights", '''
def dispatch(x, weights, experts, w1, w3, w2):
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        y = F.linear(F.silu(F.linear(x, w1[e])) * F.linear(x, w3[e]), w2[e])
        gate = (weights * (experts == e)).sum(dim=-1, keepdim=True)
        out += gate * y
    return out
''', says="only the experts some token chose"),
    Mistake("dispatch", "every expert on every token, the chosen rows gathered afterwards", '''
def dispatch(x, weights, experts, w1, w3, w2):
    h = F.silu(torch.einsum("nd,eid->eni", x, w1)) * torch.einsum("nd,eid->eni", x, w3)
    y = torch.einsum("eni,edi->end", h, w2)
    rows = torch.arange(x.shape[0])
    return sum(weights[:, j, None] * y[experts[:, j], rows] for j in range(experts.shape[1]))
''', says="only on the rows routed to it"),
    # right values, FLOPs and call count: but each pair gets its own copy of its expert's weights
    Mistake("dispatch", "gathers each pair's expert weights (w1[experts]) for one bmm over all "
            "pairs", '''
def dispatch(x, weights, experts, w1, w3, w2):
    n, k = experts.shape
    flat = experts.reshape(-1)
    tokens = torch.arange(n * k) // k
    xs = x[tokens][:, :, None]
    h = F.silu(torch.bmm(w1[flat], xs)[..., 0]) * torch.bmm(w3[flat], xs)[..., 0]
    y = torch.bmm(w2[flat], h[:, :, None])[..., 0] * weights.reshape(-1)[:, None]
    return torch.zeros_like(x).index_add_(0, tokens, y)
''', says="once for every pair"),
    Mistake("dispatch", "one expert product per token (the oracle loop), not grouped", '''
def dispatch(x, weights, experts, w1, w3, w2):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[n, j])
            h = F.silu(x[n:n + 1] @ w1[e].T) * (x[n:n + 1] @ w3[e].T)
            out[n] += weights[n, j] * (h @ w2[e].T)[0]
    return out
''', says="one product per chosen expert"),
    # ------------------------------------------------------------ distinct experts
    Mistake("expected_distinct", "lets a token pick an expert twice: (1 - 1/E)^(B k)",
            _DISTINCT.format(formula="n_experts * (1 - (1 - 1 / n_experts) ** (batch * k))"),
            says="k different experts"),
    Mistake("expected_distinct", "counts B k, capped at E: no sharing",
            _DISTINCT.format(formula="min(n_experts, batch * k)"), says="at least one"),
    Mistake("expected_distinct", "uses the chance of being chosen, (k/E)^B",
            _DISTINCT.format(formula="n_experts * (1 - (k / n_experts) ** batch)"),
            says="one token gives k"),
    Mistake("expected_distinct", "accepts any k", '''
def expected_distinct(n_experts, k, batch):
    return n_experts * (1 - (1 - k / n_experts) ** batch)
''', says="refuse anything else"),
    # ------------------------------------------------------------ bytes per step
    Mistake("decode_bytes", "reads the dense weights once per sequence", '''
def decode_bytes(dense_bytes, expert_bytes, n_moe_layers, n_experts, k, batch):
    return (dense_bytes * batch
            + n_moe_layers * expected_distinct(n_experts, k, batch) * expert_bytes)
''', says="once per step"),
    Mistake("decode_bytes", "reads B k experts per layer (capped at E)", '''
def decode_bytes(dense_bytes, expert_bytes, n_moe_layers, n_experts, k, batch):
    return dense_bytes + n_moe_layers * min(n_experts, batch * k) * expert_bytes
''', says="count the distinct experts"),
    Mistake("decode_bytes", "reads k experts per layer at any batch", '''
def decode_bytes(dense_bytes, expert_bytes, n_moe_layers, n_experts, k, batch):
    return dense_bytes + n_moe_layers * k * expert_bytes
''', says="whole batch"),
    Mistake("decode_bytes", "forgets that every MoE layer reads its own experts", '''
def decode_bytes(dense_bytes, expert_bytes, n_moe_layers, n_experts, k, batch):
    return dense_bytes + expected_distinct(n_experts, k, batch) * expert_bytes
''', says="every MoE layer"),
    # ------------------------------------------------------------ capacity
    # The tests' reference lives in the hidden part only, so an answer that calls it fails at
    # the first visible check (NameError); it stays first of its exercise's mistakes: once a
    # trial has passed the visible checks, the hidden part has defined the reference in the kernel.
    Mistake("kept_pairs", "calls the tests' own reference_kept", '''
def kept_pairs(experts, n_experts, capacity):
    return reference_kept(experts, n_experts, capacity)
''', says="is not defined"),
    Mistake("kept_pairs", "keeps the latest pairs of each expert instead of the earliest", '''
def kept_pairs(experts, n_experts, capacity):
    taken = [0] * n_experts
    kept = torch.zeros(experts.shape, dtype=torch.bool)
    for n in reversed(range(experts.shape[0])):
        for j in reversed(range(experts.shape[1])):
            e = int(experts[n, j])
            kept[n, j] = taken[e] < capacity
            taken[e] += 1
    return kept
''', says="earliest tokens"),
    Mistake("kept_pairs", "keeps capacity + 1 pairs (<= instead of <)",
            _KEPT.format(compare="<="), says="at most capacity"),
    Mistake("kept_pairs", "counts the capacity per token, not per expert", '''
def kept_pairs(experts, n_experts, capacity):
    return torch.arange(experts.shape[1]).expand(experts.shape) < capacity
''', says="each expert receives"),
    Mistake("kept_pairs", "takes every token's first choice before any second choice", '''
def kept_pairs(experts, n_experts, capacity):
    taken = [0] * n_experts
    kept = torch.zeros(experts.shape, dtype=torch.bool)
    for j in range(experts.shape[1]):
        for n in range(experts.shape[0]):
            e = int(experts[n, j])
            kept[n, j] = taken[e] < capacity
            taken[e] += 1
    return kept
''', says="token order"),
    # ------------------------------------------------------------ expert parallelism
    Mistake("ep_moe", "deals the experts out round-robin (expert e on rank e % p), not in "
            "contiguous blocks", _ep(owner="sorted_experts % p",
                                     local="sorted_experts[owner == q] // p"),
            says="contiguous block"),
    Mistake("ep_moe", "looks up the global expert id in the rank's shard",
            _ep(local="sorted_experts[owner == q]"), says="local indices"),
    Mistake("ep_moe", "adds the returned rows (sorted by expert) to the tokens of the unsorted "
            "pairs", _ep(combine="out.index_add_(0, torch.arange(len(tokens)) // k, "
                                 "torch.cat(back[r]) * pair_weights[:, None])"),
            says="order you sent them"),
    Mistake("ep_moe", "never applies the routing weights",
            _ep(combine="out.index_add_(0, tokens, torch.cat(back[r]))"), says="routing weight"),
    Mistake("ep_moe", "index_copy_: a token's k returned rows overwrite each other",
            _ep(combine="out.index_copy_(0, tokens, torch.cat(back[r]) * pair_weights[:, None])"),
            says="added together"),
    Mistake("ep_moe", "runs every pair at home with the other ranks' shards: no all-to-all", '''
def ep_moe(xs, routes, shards, all_to_all):
    per = shards[0][0].shape[0]
    outs = []
    for x, (weights, experts) in zip(xs, routes):
        out = torch.zeros_like(x)
        for n in range(x.shape[0]):
            for j in range(experts.shape[1]):
                e = int(experts[n, j])
                w1, w3, w2 = (w[e % per] for w in shards[e // per])
                h = F.silu(x[n:n + 1] @ w1.T) * (x[n:n + 1] @ w3.T)
                out[n] += weights[n, j] * (h @ w2.T)[0]
        outs.append(out)
    return outs
''', says="send rank q only the rows"),
    # ------------------------------------------------------------ self-checks
    Mistake("q1", "thinks renormalizing keeps the full softmax's probabilities", 'answer_q1 = "D"\n'),
    Mistake("q2", "rounds the batch down", "answer_q2 = 10\n"),
    Mistake("q2", "counts B k = 64 without sharing", "answer_q2 = 8\n"),
    Mistake("q3", "thinks a capacity slows decoding down", 'answer_q3 = "B"\n'),
]

# expected_distinct is called by decode_bytes, whose tests swap in the package's version: a bug
# in it costs only its own exercise.
_KEEPS = {"expected_distinct": ("decode_bytes",)}
MISTAKES = [replace(m, keeps=_KEEPS.get(m.grade_id, ())) for m in MISTAKES]

_TOPK_DIM = "torch.topk's dim defaults to the last dimension, -1"
_EP_ORDER = ("within one expert, the order of its pairs changes only the order of the rows sent "
             "to its rank and back; tokens and weights are permuted with them")
_EP_PER = ("every rank's shard holds the same number of experts, E / p, as the leading dimension "
           "of each of its three tensors")
EQUIVALENT_MUTANTS = {
    "route_topk: weights, experts = torch.topk(probs, k, dim=-1) => weights, experts = "
    "torch.topk(probs, k)": _TOPK_DIM,
    "route_deepseek: best_two = choice.view(n, n_group, e // n_group).topk(2, dim=-1).values"
    ".sum(dim=-1) => best_two = choice.view(n, n_group, e // n_group).topk(2).values"
    ".sum(dim=-1)": _TOPK_DIM,
    "route_deepseek: groups = best_two.topk(topk_group, dim=-1).indices => groups = "
    "best_two.topk(topk_group).indices": _TOPK_DIM,
    'route_deepseek: experts = choice.masked_fill(~eligible, float("-inf")).topk(k, dim=-1)'
    '.indices => experts = choice.masked_fill(~eligible, float("-inf")).topk(k).indices':
        _TOPK_DIM,
    "dispatch: order = torch.argsort(flat, stable=True) => order = torch.argsort(flat)":
        "within one expert's run, the order of its pairs only changes the order in which "
        "index_add_ adds them: tokens and weights are permuted together",
    "dispatch: order = torch.argsort(flat, stable=True) => order = torch.argsort(flat, "
    "stable=False)":
        "within one expert's run, the order of its pairs only changes the order in which "
        "index_add_ adds them: tokens and weights are permuted together",
    "ep_moe: order = torch.argsort(flat, stable=True) => order = torch.argsort(flat)": _EP_ORDER,
    "ep_moe: order = torch.argsort(flat, stable=True) => order = torch.argsort(flat, "
    "stable=False)": _EP_ORDER,
    "ep_moe: per = shards[0][0].shape[0] => per = shards[0][1].shape[0]": _EP_PER,
    "ep_moe: per = shards[0][0].shape[0] => per = shards[0][-1].shape[0]": _EP_PER,
    "ep_moe: per = shards[0][0].shape[0] => per = shards[-1][0].shape[0]": _EP_PER,
}

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('route_topk', 'float64 softmax cast down, sort', """
def route_topk(logits, k, renormalize):
    probs = torch.softmax(logits.double(), -1)
    vals, idx = probs.sort(dim=-1, descending=True)
    w, e = vals[:, :k], idx[:, :k]
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w.float(), e
"""),
    Alternative('route_deepseek', 'loop per token', """
def route_deepseek(logits, bias, k, n_group, topk_group, scale):
    scores = torch.sigmoid(logits.to(torch.float32))
    N, E = scores.shape
    size = E // n_group
    W = torch.empty(N, k); X = torch.empty(N, k, dtype=torch.int64)
    for n in range(N):
        b = scores[n] + bias
        gs = [float(b[g*size:(g+1)*size].topk(2).values.sum()) for g in range(n_group)]
        keep = sorted(range(n_group), key=lambda g: -gs[g])[:topk_group]
        cand = torch.full((E,), float('-inf'))
        for g in keep:
            cand[g*size:(g+1)*size] = b[g*size:(g+1)*size]
        e = cand.topk(k).indices
        w = scores[n, e]
        W[n], X[n] = w / w.sum() * scale, e
    return W, X
"""),
    Alternative('expected_distinct', 'complement form, math.pow', """
def expected_distinct(n_experts, k, batch):
    if k < 1 or k > n_experts:
        raise ValueError(f"k={k} must be in [1, {n_experts}]")
    miss = math.pow(1.0 - k / n_experts, batch)
    return n_experts - n_experts * miss
"""),
    Alternative('decode_bytes', 'reordered', """
def decode_bytes(dense_bytes, expert_bytes, n_moe_layers, n_experts, k, batch):
    per_layer = expert_bytes * expected_distinct(n_experts, k, batch)
    return per_layer * n_moe_layers + dense_bytes
"""),
    Alternative('kept_pairs', 'dict counter', """
from collections import Counter
def kept_pairs(experts, n_experts, capacity):
    seen = Counter()
    out = []
    for row in experts.tolist():
        r = []
        for e in row:
            seen[e] += 1
            r.append(seen[e] <= capacity)
        out.append(r)
    return torch.tensor(out, dtype=torch.bool).reshape(experts.shape)
"""),
    Alternative('ep_moe', 'token-order sends, global ids, weights applied on the home rank', """
def ep_moe(xs, routes, shards, all_to_all):
    p = len(xs)
    per = shards[0][0].shape[0]
    send_rows, send_ids, keep = [], [], []
    for r in range(p):
        w, e = routes[r]
        k = e.shape[1]
        tok = torch.arange(e.shape[0]).repeat_interleave(k)
        fe, fw = e.reshape(-1), w.reshape(-1)
        dest = fe // per
        send_rows.append([xs[r][tok[dest == q]] for q in range(p)])
        send_ids.append([fe[dest == q] for q in range(p)])
        keep.append([(tok[dest == q], fw[dest == q]) for q in range(p)])
    got_rows, got_ids = all_to_all(send_rows), all_to_all(send_ids)
    replies = []
    for q in range(p):
        w1, w3, w2 = shards[q]
        row = []
        for s in range(p):
            x, ids = got_rows[q][s], got_ids[q][s] - q * per
            y = torch.zeros_like(x)
            for e in ids.unique().tolist():
                m = ids == e
                y[m] = (F.silu(x[m] @ w1[e].T) * (x[m] @ w3[e].T)) @ w2[e].T
            row.append(y)
        replies.append(row)
    back = all_to_all(replies)
    outs = []
    for r in range(p):
        out = torch.zeros_like(xs[r])
        for q in range(p):
            tok, fw = keep[r][q]
            out.index_add_(0, tok, back[r][q] * fw[:, None])
        outs.append(out)
    return outs
"""),
    Alternative('q2', 'computed with math.ceil', """
import math
answer_q2 = math.ceil(math.log(0.5) / math.log(1 - 8 / 128))
"""),
    Alternative('q2', 'numpy integer from a search', """
import numpy as np
answer_q2 = np.argmax(128 * (1 - (1 - 8 / 128) ** np.arange(100)) >= 64)
"""),
    # an integer self-check answer computed with numpy (np.int64 is a numbers.Integral)
    Alternative('q2', 'a NumPy int64 from np.argmax', '''
# Set answer_q2 to an integer.
import numpy as np
_B = np.arange(1, 129)
answer_q2 = _B[np.argmax(128 * (1 - (1 - 8 / 128) ** _B) >= 64)]
'''),
]
