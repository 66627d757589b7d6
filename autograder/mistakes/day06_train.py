"""Day 06 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    # ---- get_batch ------------------------------------------------------------------------
    Mistake("get_batch", "targets not shifted: y = x", """
def get_batch(data, batch_size, block_size, generator):
    starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    return x, x.clone()
"""),
    Mistake("get_batch", "shifted the wrong way: y is the token before x", """
def get_batch(data, batch_size, block_size, generator):
    starts = torch.randint(1, len(data) - block_size + 1, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s - 1:s - 1 + block_size] for s in starts.tolist()])
    return x, y
"""),
    Mistake("get_batch", "upper bound one too small: the last window is never drawn", """
def get_batch(data, batch_size, block_size, generator):
    starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + block_size + 1] for s in starts.tolist()])
    return x, y
"""),
    Mistake("get_batch", "ignores the generator (global RNG: not reproducible)", """
def get_batch(data, batch_size, block_size, generator):
    starts = torch.randint(0, len(data) - block_size, (batch_size,))
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + block_size + 1] for s in starts.tolist()])
    return x, y
"""),
    Mistake("get_batch", "draws separate starts for x and y", """
def get_batch(data, batch_size, block_size, generator):
    sx = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
    sy = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + block_size] for s in sx.tolist()])
    y = torch.stack([data[s + 1:s + block_size + 1] for s in sy.tolist()])
    return x, y
""", says="same window"),
    # ---- lm_loss --------------------------------------------------------------------------
    Mistake("lm_loss", "passes (B, T, V) logits to F.cross_entropy without flattening", """
def lm_loss(logits, targets):
    return F.cross_entropy(logits, targets)
""", says="flatten them to (B*T, V)"),
    Mistake("lm_loss", "softmax before cross_entropy (softmax applied twice)", """
def lm_loss(logits, targets):
    probs = torch.softmax(logits, dim=-1)
    return F.cross_entropy(probs.reshape(-1, probs.shape[-1]), targets.reshape(-1))
"""),
    Mistake("lm_loss", "sums over positions instead of averaging", """
def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum")
"""),
    Mistake("lm_loss", "targets flattened in a different order than the logits", """
def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.t().reshape(-1))
"""),
    Mistake("lm_loss", "returns a Python float: backward() is impossible", """
def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()
"""),
    Mistake("lm_loss", "log of softmax written out: overflows to inf for large logits", """
def lm_loss(logits, targets):
    e = torch.exp(logits)
    p = e / e.sum(dim=-1, keepdim=True)
    return -torch.log(p.gather(-1, targets[..., None])).mean()
"""),
    # ---- lr_at ----------------------------------------------------------------------------
    Mistake("lr_at", "warm-up starts at 0 (step / warmup_steps): the first step is wasted", """
def lr_at(step, steps, max_lr, warmup_steps, min_lr):
    if not 0 <= step < steps:
        raise ValueError(f"step must be in [0, {steps}), got {step}")
    if step < warmup_steps:
        return max_lr * step / warmup_steps
    progress = (step - warmup_steps) / max(steps - warmup_steps - 1, 1)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
"""),
    Mistake("lr_at", "cosine decays to 0 instead of min_lr", """
def lr_at(step, steps, max_lr, warmup_steps, min_lr):
    if not 0 <= step < steps:
        raise ValueError(f"step must be in [0, {steps}), got {step}")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(steps - warmup_steps - 1, 1)
    return 0.5 * max_lr * (1.0 + math.cos(math.pi * progress))
""", says="ending at min_lr, not 0"),
    Mistake("lr_at", "progress divided by steps - warmup: never reaches min_lr", """
def lr_at(step, steps, max_lr, warmup_steps, min_lr):
    if not 0 <= step < steps:
        raise ValueError(f"step must be in [0, {steps}), got {step}")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / (steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
"""),
    Mistake("lr_at", "clamps an out-of-range step instead of raising", """
def lr_at(step, steps, max_lr, warmup_steps, min_lr):
    step = min(max(step, 0), steps - 1)
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(steps - warmup_steps - 1, 1)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
""", says="do not clamp"),
    Mistake("lr_at", "full cosine period: goes down and comes back up", """
def lr_at(step, steps, max_lr, warmup_steps, min_lr):
    if not 0 <= step < steps:
        raise ValueError(f"step must be in [0, {steps}), got {step}")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(steps - warmup_steps - 1, 1)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(2 * math.pi * progress))
""", says="half a cosine"),
    # ---- train_step -----------------------------------------------------------------------
    # The tests' reference lives in the hidden part only, so an answer that calls it fails at
    # the first visible check (NameError); it stays first of its exercise's mistakes: once a
    # trial has passed the visible checks, the hidden part has defined the reference in the kernel.
    Mistake("train_step", "calls the tests' own reference_step", """
def train_step(model, optimizer, x, y, grad_clip):
    return reference_step(model, optimizer, x, y, grad_clip)
""", says="is not defined"),
    Mistake("train_step", "forgets zero_grad: gradients accumulate over steps", """
def train_step(model, optimizer, x, y, grad_clip):
    loss = lm_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()
"""),
    Mistake("train_step", "steps before backward: the step sees no gradient, nothing is learned", """
def train_step(model, optimizer, x, y, grad_clip):
    optimizer.zero_grad()
    loss = lm_loss(model(x), y)
    optimizer.step()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    return loss.item()
"""),
    Mistake("train_step", "clips after the optimizer step (too late)", """
def train_step(model, optimizer, x, y, grad_clip):
    optimizer.zero_grad()
    loss = lm_loss(model(x), y)
    loss.backward()
    optimizer.step()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    return loss.item()
"""),
    Mistake("train_step", "clips each gradient value instead of the norm", """
def train_step(model, optimizer, x, y, grad_clip):
    optimizer.zero_grad()
    loss = lm_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()
"""),
    Mistake("train_step", "returns the loss tensor instead of a float", """
def train_step(model, optimizer, x, y, grad_clip):
    optimizer.zero_grad()
    loss = lm_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss
"""),
    Mistake("train_step", "returns the loss recomputed after the update", """
def train_step(model, optimizer, x, y, grad_clip):
    optimizer.zero_grad()
    loss = lm_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    with torch.no_grad():
        return lm_loss(model(x), y).item()
"""),
    # ---- sequence_log_prob ----------------------------------------------------------------
    Mistake("sequence_log_prob", "off by one: reads the logits at the token's own position", """
def sequence_log_prob(model, context_ids, continuation_ids):
    if len(context_ids) == 0:
        raise ValueError("empty context")
    ids = torch.tensor([list(context_ids) + list(continuation_ids)])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids)[0], dim=-1)
    start = len(context_ids)
    return float(sum(log_probs[min(start + i, ids.shape[1] - 1), t]
                     for i, t in enumerate(continuation_ids)))
"""),
    Mistake("sequence_log_prob", "scores every token with the last context position's logits", """
def sequence_log_prob(model, context_ids, continuation_ids):
    if len(context_ids) == 0:
        raise ValueError("empty context")
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([list(context_ids)]))[0, -1], dim=-1)
    return float(sum(log_probs[t] for t in continuation_ids))
"""),
    Mistake("sequence_log_prob", "adds raw logits instead of log-probabilities", """
def sequence_log_prob(model, context_ids, continuation_ids):
    if len(context_ids) == 0:
        raise ValueError("empty context")
    ids = torch.tensor([list(context_ids) + list(continuation_ids)])
    with torch.no_grad():
        logits = model(ids)[0]
    start = len(context_ids) - 1
    return float(sum(logits[start + i, t] for i, t in enumerate(continuation_ids)))
"""),
    Mistake("sequence_log_prob", "log base 2 instead of the natural log", """
def sequence_log_prob(model, context_ids, continuation_ids):
    if len(context_ids) == 0:
        raise ValueError("empty context")
    ids = torch.tensor([list(context_ids) + list(continuation_ids)])
    with torch.no_grad():
        probs = torch.softmax(model(ids)[0], dim=-1)
    start = len(context_ids) - 1
    return float(sum(torch.log2(probs[start + i, t]) for i, t in enumerate(continuation_ids)))
"""),
    # ---- kl_divergence --------------------------------------------------------------------
    Mistake("kl_divergence", "reversed: KL(q || p)", """
def kl_divergence(p, q):
    support = [w for w, pw in p.items() if pw > 0]
    for w in support:
        if q.get(w, 0.0) <= 0:
            raise ValueError(f"q gives {w!r} no probability")
    mass = sum(q[w] for w in support)
    return float(sum(q[w] / mass * math.log((q[w] / mass) / p[w]) for w in support))
"""),
    Mistake("kl_divergence", "log base 2 (bits) instead of nats", """
def kl_divergence(p, q):
    support = [w for w, pw in p.items() if pw > 0]
    for w in support:
        if q.get(w, 0.0) <= 0:
            raise ValueError(f"q gives {w!r} no probability")
    mass = sum(q[w] for w in support)
    return float(sum(p[w] * math.log2(p[w] / (q[w] / mass)) for w in support))
"""),
    Mistake("kl_divergence", "does not renormalise q over p's words", """
def kl_divergence(p, q):
    support = [w for w, pw in p.items() if pw > 0]
    for w in support:
        if q.get(w, 0.0) <= 0:
            raise ValueError(f"q gives {w!r} no probability")
    return float(sum(p[w] * math.log(p[w] / q[w]) for w in support))
"""),
    Mistake("kl_divergence", "skips words the model gives no probability (hides an infinite KL)", """
def kl_divergence(p, q):
    support = [w for w, pw in p.items() if pw > 0 and q.get(w, 0.0) > 0]
    mass = sum(q[w] for w in support)
    return float(sum(p[w] * math.log(p[w] / (q[w] / mass)) for w in support))
""", says="don't skip it"),
    Mistake("kl_divergence", "clamps q to a tiny epsilon instead of raising", """
def kl_divergence(p, q):
    support = [w for w, pw in p.items() if pw > 0]
    qs = {w: max(q.get(w, 0.0), 1e-12) for w in support}
    mass = sum(qs.values())
    return float(sum(p[w] * math.log(p[w] / (qs[w] / mass)) for w in support))
""", says="clamp q to a tiny number"),
    Mistake("kl_divergence", "renormalises q over all its words instead of p's", """
def kl_divergence(p, q):
    support = [w for w, pw in p.items() if pw > 0]
    for w in support:
        if q.get(w, 0.0) <= 0:
            raise ValueError(f"q gives {w!r} no probability")
    mass = sum(q.values())
    return float(sum(p[w] * math.log(p[w] / (q[w] / mass)) for w in support))
"""),
    Mistake("kl_divergence", "the ValueError's message does not name the word", """
def kl_divergence(p, q):
    support = [w for w, pw in p.items() if pw > 0]
    for w in support:
        if q.get(w, 0.0) <= 0:
            raise ValueError("KL is infinite: q gives zero probability to a word p can produce")
    mass = sum(q[w] for w in support)
    return float(sum(p[w] * math.log(p[w] / (q[w] / mass)) for w in support))
""", says="say which word makes KL infinite"),
    # ---- self-check -----------------------------------------------------------------------
    Mistake("q1", "answers in bits: log2(1000)", """
answer_q1 = math.log2(1000)
"""),
    Mistake("q1", "answers the probability 1/V instead of the loss", """
answer_q1 = 1 / 1000
"""),
    Mistake("q2", "thinks the missing word drops out of the sum", """
answer_q2 = "B"
"""),
    Mistake("q2", "thinks KL is the missed probability", """
answer_q2 = "D"
"""),
    Mistake("q3", "blames the model size", """
answer_q3 = "B"
"""),
    Mistake("q3", "blames the learning-rate schedule", """
answer_q3 = "C"
"""),
]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
EQUIVALENT_MUTANTS = {
    'sequence_log_prob: log_probs = torch.log_softmax(model(ids)[0].float(), dim=-1)     # (n + k, V) => log_probs = torch.log_softmax(model(ids)[-1].float(), dim=-1)     # (n + k, V)':
        'the batch has one row: row 0 is row -1',
    'q1: answer_q1 = math.log(1000) => answer_q1 = math.log(1001)':
        "within the question's stated tolerance",
    'q1: answer_q1 = math.log(1000) => answer_q1 = math.log(999)':
        "within the question's stated tolerance",
}

# One mistake, one charge: train_step is tested with the package's loss swapped in for lm_loss,
# so a bug in lm_loss leaves it its full marks.
MISTAKES = [replace(m, keeps=("train_step",))
            if m.name in ("sums over positions instead of averaging",
                          "softmax before cross_entropy (softmax applied twice)") else m
            for m in MISTAKES]

# Right answers written another way: each must keep full marks (tests/test_grading_proofs.py).
ALTERNATIVES = [
    Alternative('lr_at', 'numpy cos, Step message', '''
def lr_at(step, steps, max_lr, warmup_steps, min_lr):
    if step < 0 or step >= steps:
        raise ValueError(f"Step {step} is outside [0, {steps})")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(steps - warmup_steps - 1, 1)
    return min_lr + (max_lr - min_lr) * 0.5 * (1 + np.cos(np.pi * progress))
'''),
    Alternative('get_batch', 'unfold windows', '''
def get_batch(data, batch_size, block_size, generator):
    starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
    windows = data.unfold(0, block_size + 1, 1)[starts]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
'''),
    Alternative('lm_loss', 'cross_entropy on (B, V, T)', '''
def lm_loss(logits, targets):
    return F.cross_entropy(logits.transpose(1, 2), targets)
'''),
    Alternative('train_step', 'set_to_none, float(loss)', '''
def train_step(model, optimizer, x, y, grad_clip):
    model.train()
    optimizer.zero_grad(set_to_none=True)
    logits = model(x)
    loss = lm_loss(logits, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip)
    optimizer.step()
    return float(loss.detach())
'''),
    Alternative('sequence_log_prob', 'F.cross_entropy sum', '''
def sequence_log_prob(model, context_ids, continuation_ids):
    if not context_ids:
        raise ValueError("context_ids is empty")
    k = len(continuation_ids)
    if k == 0:
        return 0.0
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logits = model(ids)[0, len(context_ids) - 1:-1]
    return -F.cross_entropy(logits, torch.tensor(continuation_ids), reduction="sum").item()
'''),
    Alternative('kl_divergence', 'numpy arrays', '''
def kl_divergence(p, q):
    words = [w for w in p if p[w] > 0]
    missing = [w for w in words if q.get(w, 0) <= 0]
    if missing:
        raise ValueError(f"q gives zero probability to {missing[0]!r}")
    pv = np.array([p[w] for w in words])
    qv = np.array([q[w] for w in words])
    qv = qv / qv.sum()
    return float(np.sum(pv * np.log(pv / qv)))
'''),
    Alternative('q1', 'rounded', '''
answer_q1 = 6.91'''),
    Alternative('kl_divergence', 'message names the word in a sentence, no repr', '''
def kl_divergence(p, q):
    support = [w for w, pw in p.items() if pw > 0]
    missing = [w for w in support if not q.get(w, 0.0) > 0]
    if missing:
        raise ValueError(f"KL is infinite: the model gives zero probability to {', '.join(missing)}")
    mass = sum(q[w] for w in support)
    return float(sum(p[w] * math.log(p[w] / (q[w] / mass)) for w in support))
'''),
]
