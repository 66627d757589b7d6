"""Day 08 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

# the loop as the solution writes it; most of its mistakes are this with one or two edits
_LOOP = """
def generate_uncached(model, prompt_ids, params, eos_id=None, generator=None):
    max_seq_len = model.cfg.max_seq_len
    if generator is None and params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long)
    ids, new = prompt, []
    with torch.inference_mode():
        while True:
            logits = model(ids[:, -max_seq_len:])[:, -1, :]
            token = int(sample_next_token(logits, params, generator=generator, prompt_ids=prompt,
                                          generated_ids=ids[:, prompt.shape[1]:]))
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if eos_id is not None and token == eos_id:
                return new, "eos"
            if len(new) == params.max_new_tokens:
                return new, "length"
"""


def _loop(*edits: tuple[str, str]) -> str:
    """_LOOP with each (old, new) made, each old found exactly once."""
    text = _LOOP
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


MISTAKES = [
    # ---------------------------------------------------------------- repetition penalty
    Mistake("repetition_penalty", "multiplies positive logits and divides negative ones "
            "(the branches swapped: seen tokens become MORE likely)", """
def apply_repetition_penalty(logits, seen_ids, penalty):
    if penalty <= 0:
        raise ValueError(f"penalty must be > 0, got {penalty}")
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen.scatter_(1, seen_ids, True)
    penalized = torch.where(logits > 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)
"""),
    Mistake("repetition_penalty", "divides every seen logit, whatever its sign", """
def apply_repetition_penalty(logits, seen_ids, penalty):
    if penalty <= 0:
        raise ValueError(f"penalty must be > 0, got {penalty}")
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen.scatter_(1, seen_ids, True)
    return torch.where(seen, logits / penalty, logits)
"""),
    Mistake("repetition_penalty", "penalizes once per occurrence instead of once per distinct "
            "token", """
def apply_repetition_penalty(logits, seen_ids, penalty):
    if penalty <= 0:
        raise ValueError(f"penalty must be > 0, got {penalty}")
    out = logits.clone()
    for b in range(seen_ids.shape[0]):
        for t in seen_ids[b].tolist():
            x = out[b, t]
            out[b, t] = x / penalty if x > 0 else x * penalty
    return out
"""),
    Mistake("repetition_penalty", "writes into the caller's logits in place", """
def apply_repetition_penalty(logits, seen_ids, penalty):
    if penalty <= 0:
        raise ValueError(f"penalty must be > 0, got {penalty}")
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen.scatter_(1, seen_ids, True)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits[seen] = penalized[seen]
    return logits
""", says="build a new tensor"),
    Mistake("repetition_penalty", "uses the first row's seen ids for every row", """
def apply_repetition_penalty(logits, seen_ids, penalty):
    if penalty <= 0:
        raise ValueError(f"penalty must be > 0, got {penalty}")
    seen = torch.zeros(logits.shape[1], dtype=torch.bool)
    seen[seen_ids[0]] = True
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen[None, :], penalized, logits)
"""),
    Mistake("repetition_penalty", "accepts a penalty <= 0 silently", """
def apply_repetition_penalty(logits, seen_ids, penalty):
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen.scatter_(1, seen_ids, True)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)
"""),
    # ---------------------------------------------------------------- frequency / presence
    Mistake("frequency_presence", "charges the presence penalty once per occurrence", """
def apply_frequency_presence_penalty(logits, generated_ids, frequency, presence):
    counts = torch.zeros_like(logits)
    counts.scatter_add_(1, generated_ids, torch.ones_like(generated_ids, dtype=logits.dtype))
    return logits - counts * (frequency + presence)
"""),
    Mistake("frequency_presence", "scatter_ instead of scatter_add_: every count is 1", """
def apply_frequency_presence_penalty(logits, generated_ids, frequency, presence):
    counts = torch.zeros_like(logits)
    counts.scatter_(1, generated_ids, 1.0)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence
"""),
    Mistake("frequency_presence", "adds the penalties instead of subtracting them", """
def apply_frequency_presence_penalty(logits, generated_ids, frequency, presence):
    counts = torch.zeros_like(logits)
    counts.scatter_add_(1, generated_ids, torch.ones_like(generated_ids, dtype=logits.dtype))
    return logits + counts * frequency + (counts > 0).to(logits.dtype) * presence
"""),
    Mistake("frequency_presence", "counts over the whole batch instead of per row", """
def apply_frequency_presence_penalty(logits, generated_ids, frequency, presence):
    counts = torch.bincount(generated_ids.flatten(), minlength=logits.shape[1]).to(logits.dtype)
    counts = counts[None, :]
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence
"""),
    Mistake("frequency_presence", "subtracts in place from the caller's logits", """
def apply_frequency_presence_penalty(logits, generated_ids, frequency, presence):
    counts = torch.zeros_like(logits)
    counts.scatter_add_(1, generated_ids, torch.ones_like(generated_ids, dtype=logits.dtype))
    logits -= counts * frequency + (counts > 0).to(logits.dtype) * presence
    return logits
"""),
    # ---------------------------------------------------------------- stop-string matcher
    Mistake("safe_text", "never holds text back: streams the start of a stop string", """
def safe_text_length(text, stop):
    starts = [text.find(s) for s in stop if s in text]
    if starts:
        return min(starts), True
    return len(text), False
"""),
    Mistake("safe_text", "holds back only from the last occurrence of a stop string's first "
            "character", """
def safe_text_length(text, stop):
    starts = [text.find(s) for s in stop if s in text]
    if starts:
        return min(starts), True
    held = 0
    for s in stop:
        i = text.rfind(s[0])
        if i >= 0 and s.startswith(text[i:]) and len(text) - i < len(s):
            held = max(held, len(text) - i)
    return len(text) - held, False
"""),
    Mistake("safe_text", "holds back a single character at most", """
def safe_text_length(text, stop):
    starts = [text.find(s) for s in stop if s in text]
    if starts:
        return min(starts), True
    if any(len(s) > 1 and text.endswith(s[0]) for s in stop):
        return len(text) - 1, False
    return len(text), False
"""),
    Mistake("safe_text", "lets the stop string itself through", """
def safe_text_length(text, stop):
    ends = [text.find(s) + len(s) for s in stop if s in text]
    if ends:
        return min(ends), True
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return len(text) - held, False
"""),
    Mistake("safe_text", "the first stop string of the list wins, not the earliest in the text",
            """
def safe_text_length(text, stop):
    for s in stop:
        if s in text:
            return text.find(s), True
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return len(text) - held, False
"""),
    Mistake("safe_text", "holds back for the first stop string only", """
def safe_text_length(text, stop):
    starts = [text.find(s) for s in stop if s in text]
    if starts:
        return min(starts), True
    held = 0
    for s in stop[:1]:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return len(text) - held, False
"""),
    # ---------------------------------------------------------------- the loop
    Mistake("generate_loop", "off by one: generates max_new_tokens + 1 tokens", _loop(
        ("while True:", "while len(new) <= params.max_new_tokens:"),
        ('            if len(new) == params.max_new_tokens:\n                return new, "length"\n',
         '    return new, "length"\n'))),
    Mistake("generate_loop", "`if eos_id and ...`: an EOS id of 0 never stops the loop", _loop(
        ("if eos_id is not None and token", "if eos_id and token")), says="is False when eos_id is 0"),
    Mistake("generate_loop", "drops the EOS id from the returned ids", """
def generate_uncached(model, prompt_ids, params, eos_id=None, generator=None):
    max_seq_len = model.cfg.max_seq_len
    if generator is None and params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long)
    ids, new = prompt, []
    with torch.inference_mode():
        while True:
            logits = model(ids[:, -max_seq_len:])[:, -1, :]
            token = int(sample_next_token(logits, params, generator=generator, prompt_ids=prompt,
                                          generated_ids=ids[:, prompt.shape[1]:]))
            if eos_id is not None and token == eos_id:
                return new, "eos"
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if len(new) == params.max_new_tokens:
                return new, "length"
"""),
    Mistake("generate_loop", "checks the length limit before EOS: a final EOS reports "
            "'length'", """
def generate_uncached(model, prompt_ids, params, eos_id=None, generator=None):
    max_seq_len = model.cfg.max_seq_len
    if generator is None and params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long)
    ids, new = prompt, []
    with torch.inference_mode():
        while True:
            logits = model(ids[:, -max_seq_len:])[:, -1, :]
            token = int(sample_next_token(logits, params, generator=generator, prompt_ids=prompt,
                                          generated_ids=ids[:, prompt.shape[1]:]))
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if len(new) == params.max_new_tokens:
                return new, "length"
            if eos_id is not None and token == eos_id:
                return new, "eos"
"""),
    Mistake("generate_loop", "frequency / presence penalties counted over the prompt too "
            "(generated_ids = the whole context)", _loop(
        ("prompt_ids=prompt,\n" + " " * 42 + "generated_ids=ids[:, prompt.shape[1]:]",
         "generated_ids=ids"))),
    Mistake("generate_loop", "repetition penalty over the generated tokens only (prompt "
            "forgotten)", _loop(
        (" prompt_ids=prompt,", ""))),
    Mistake("generate_loop", "no generator: sample_next_token re-seeds at every step", _loop(
        ("    if generator is None and params.seed is not None:\n"
         "        generator = torch.Generator().manual_seed(params.seed)\n", ""))),
    Mistake("generate_loop", "takes the logits of the first position instead of the last", _loop(
        ("[:, -1, :]", "[:, 0, :]"))),
    Mistake("generate_loop", "never crops: the context outgrows the model's window", _loop(
        ("    max_seq_len = model.cfg.max_seq_len\n", ""), ("ids[:, -max_seq_len:]", "ids"))),
    Mistake("generate_loop", "returns the prompt together with the new ids", _loop(
        ('return new, "eos"', 'return ids[0].tolist(), "eos"'),
        ('return new, "length"', 'return ids[0].tolist(), "length"'))),
    # ---------------------------------------------------------------- streaming
    Mistake("stream_text", "releases everything it decodes: a stop string split across tokens "
            "leaks", """
def stream_text(token_ids, decode, stop):
    pieces, released = [], 0
    for i in range(len(token_ids)):
        text = decode(list(token_ids[:i + 1]))
        at, stopped = safe_text_length(text, stop)
        end = at if stopped else len(text)
        pieces.append(text[released:end])
        released = end
        if stopped:
            return pieces, True
    return pieces, False
"""),
    Mistake("stream_text", "checks each token's own text for a stop string, not the whole "
            "text", """
def stream_text(token_ids, decode, stop):
    pieces = []
    for i in range(len(token_ids)):
        piece = decode([token_ids[i]])
        at, stopped = safe_text_length(piece, stop)
        if stopped:
            pieces.append(piece[:at])
            return pieces, True
        pieces.append(piece)
    return pieces, False
"""),
    Mistake("stream_text", "never releases the held-back text after the last token", """
def stream_text(token_ids, decode, stop):
    pieces, released = [], 0
    for i in range(len(token_ids)):
        text = decode(list(token_ids[:i + 1]))
        safe, stopped = safe_text_length(text, stop)
        pieces.append(text[released:safe])
        released = safe
        if stopped:
            return pieces, True
    return pieces, False
"""),
    Mistake("stream_text", "keeps consuming tokens after the stop string", """
def stream_text(token_ids, decode, stop):
    pieces, released, stopped_any = [], 0, False
    for i in range(len(token_ids)):
        text = decode(list(token_ids[:i + 1]))
        safe, stopped = safe_text_length(text, stop)
        stopped_any = stopped_any or stopped
        if stopped_any:
            pieces.append("")
            continue
        if i == len(token_ids) - 1:
            safe = len(text)
        pieces.append(text[released:safe])
        released = safe
    return pieces, stopped_any
"""),
    Mistake("repetition_penalty", "returns the caller's tensor itself when nothing changes "
            "(penalty 1 or nothing seen)", """
def apply_repetition_penalty(logits, seen_ids, penalty):
    if penalty <= 0:
        raise ValueError(f"penalty must be > 0 (1 = off), got {penalty}")
    if penalty == 1 or seen_ids.numel() == 0:
        return logits
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen.scatter_(1, seen_ids, True)
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)
""", says="not a new one"),
    Mistake("frequency_presence", "returns the caller's tensor itself when nothing was generated", """
def apply_frequency_presence_penalty(logits, generated_ids, frequency, presence):
    if generated_ids.numel() == 0:
        return logits
    counts = torch.zeros_like(logits)
    counts.scatter_add_(1, generated_ids, torch.ones_like(generated_ids, dtype=logits.dtype))
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence
""", says="not a new one"),
    Mistake("generate_loop", "keeps the context in the caller's prompt list and appends to it", """
def generate_uncached(model, prompt_ids, params, eos_id=None, generator=None):
    max_seq_len = model.cfg.max_seq_len
    if generator is None and params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    n_prompt = len(prompt_ids)
    ids, new = prompt_ids, []
    with torch.inference_mode():
        while True:
            logits = model(torch.tensor([ids[-max_seq_len:]]))[:, -1, :]
            token = int(sample_next_token(logits, params, generator=generator,
                                          prompt_ids=torch.tensor([ids[:n_prompt]]),
                                          generated_ids=torch.tensor([ids[n_prompt:]],
                                                                     dtype=torch.long).reshape(1, -1)))
            new.append(token)
            ids.append(token)
            if eos_id is not None and token == eos_id:
                return new, "eos"
            if len(new) == params.max_new_tokens:
                return new, "length"
""", says="prompt_ids list"),
    Mistake("generate_loop", "gives the penalties the cropped window as prompt_ids", _loop(
        ("            logits = model(ids[:, -max_seq_len:])[:, -1, :]\n",
         "            window = ids[:, -max_seq_len:]\n            logits = model(window)[:, -1, :]\n"),
        ("prompt_ids=prompt,", "prompt_ids=window,")), says="not the cropped window"),
    Mistake("generate_loop", "generated_ids = ids[:, -len(new):]: the whole context at step 0", _loop(
        ("generated_ids=ids[:, prompt.shape[1]:]", "generated_ids=ids[:, -len(new):]")), says="-len(new)"),
    Mistake("stream_text", "adds up each token's own decode ([id]) instead of decoding the "
            "whole prefix", """
def stream_text(token_ids, decode, stop):
    pieces, released, text = [], 0, ""
    for i, token in enumerate(token_ids):
        text += decode([token])
        safe, stopped = safe_text_length(text, stop)
        if not stopped and i == len(token_ids) - 1:
            safe = len(text)
        pieces.append(text[released:safe])
        released = safe
        if stopped:
            return pieces, True
    return pieces, False
""", says="whole prefix"),
    Mistake("stream_text", "flushes at the last token even when a stop string just appeared", """
def stream_text(token_ids, decode, stop):
    pieces, released = [], 0
    for i in range(len(token_ids)):
        text = decode(list(token_ids[:i + 1]))
        safe, stopped = safe_text_length(text, stop)
        if i == len(token_ids) - 1:
            safe = len(text)
        pieces.append(text[released:safe])
        released = safe
        if stopped:
            return pieces, True
    return pieces, False
""", says="only when no stop string"),
    # ---------------------------------------------------------------- self-check
    Mistake("q1", "divides the negative logit (moves it towards 0)", 'answer_q1 = "A"'),
    Mistake("q1", "penalizes once per occurrence", 'answer_q1 = "C"'),
    Mistake("q2", "counts the prompt occurrences too", "answer_q2 = 2.0 - 7 * 0.5 - 1.0",
            says="only the 3 generated occurrences count"),
    Mistake("q2", "charges presence per occurrence", "answer_q2 = 2.0 - 3 * 0.5 - 3 * 1.0",
            says="presence is charged once"),
    Mistake("q3", "counts only the new positions", "answer_q3 = 16"),
    Mistake("q3", "counts the prompt once per step but forgets the growth", "answer_q3 = 64 * 16"),
    Mistake("q4", "streams the start of the stop string", 'answer_q4 = "A"'),
    Mistake("q4", "holds back only the last character", 'answer_q4 = "D"'),
]

# One mistake, one charge: the later exercises' tests swap in the package's version of
# the function these mistakes break, so they keep their full marks (by name prefix).
_KEEPS = {
    'never holds text back': ('stream_text',),
}
MISTAKES = [replace(m, keeps=next((v for k, v in _KEEPS.items() if m.name.startswith(k)), ()))
            for m in MISTAKES]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
EQUIVALENT_MUTANTS = {
    'repetition_penalty: penalized = torch.where(logits > 0, logits / penalty, logits * penalty) => penalized = torch.where(logits >= 0, logits / penalty, logits * penalty)':
        'a logit of exactly 0 stays 0 either way (0 / penalty == 0 * penalty)',
    'safe_text: for n in range(min(len(s) - 1, len(text)), held, -1): => for n in range(min(len(s) - 1, len(text)) + 1, held, -1):':
        'the extra n is len(s) (a whole stop string, found earlier) or len(text) + 1 (longer than the text): never a match',
    'safe_text: for n in range(min(len(s) - 1, len(text)), held, -1): => for n in range(min(len(s) - 1, len(text)), held - 1, -1):':
        'the extra n equals held: a match sets held to the value it has',
    'safe_text: for n in range(min(len(s) - 1, len(text)), held, -1): => for n in range(min(len(s) + 1, len(text)), held, -1):':
        'prefixes of length >= len(s) are the whole stop string, found earlier: never a match',
    'safe_text: for n in range(min(len(s) - 1, len(text)), held, -1): => for n in range(min(len(s) - 0, len(text)), held, -1):':
        'the extra prefix is the whole stop string, found earlier: never a match',
    'generate_loop: prompt = torch.tensor([list(prompt_ids)], dtype=torch.long) => prompt = torch.tensor([list(prompt_ids)])':
        'a tensor of Python ints is already int64 (long)',
    'generate_loop: if eos_id is not None and token == eos_id: => if token == eos_id:':
        'an int token never equals None, so the first test changes nothing',
}

# Right answers written another way: each must keep full marks (tests/test_grading_proofs.py).
ALTERNATIVES = [
    Alternative('safe_text', 'helpers named find_stop and held_back_length with their own signatures', '''
def find_stop(stop, text):
    """The earliest position where a stop string starts in text, or -1."""
    starts = [text.find(s) for s in stop if s in text]
    return min(starts) if starts else -1


def held_back_length(stop, text):
    """The longest end of text that is a proper beginning of a stop string."""
    return max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def safe_text_length(text, stop):
    """(n, stopped): text[:n] can be shown; stopped is True if a stop string occurs in text."""
    at = find_stop(stop, text)
    if at >= 0:
        return at, True
    return len(text) - held_back_length(stop, text), False
'''),
    Alternative('q3', 'a NumPy sum', '''
# Set answer_q3 to a number.
answer_q3 = np.arange(64, 80).sum()
'''),
    Alternative('repetition_penalty', 'Penalty capitalised, loop', '''
def apply_repetition_penalty(logits, seen_ids, penalty):
    if not penalty > 0:
        raise ValueError(f"Penalty must be positive, got {penalty}")
    out = logits.clone()
    for b in range(logits.shape[0]):
        for t in set(seen_ids[b].tolist()):
            x = out[b, t]
            out[b, t] = x / penalty if x > 0 else x * penalty
    return out
'''),
    Alternative('frequency_presence', 'bincount per row', '''
def apply_frequency_presence_penalty(logits, generated_ids, frequency, presence):
    V = logits.shape[-1]
    counts = torch.stack([torch.bincount(row, minlength=V) for row in generated_ids]).to(logits.dtype)
    return logits - counts * frequency - (counts > 0).float() * presence
'''),
    Alternative('generate_loop', 'list context, for loop, no_grad', '''
def generate_uncached(model, prompt_ids, params, eos_id=None, generator=None):
    if generator is None and params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    prompt = torch.tensor([prompt_ids], dtype=torch.long)
    context = list(prompt_ids)
    new_ids = []
    for _ in range(params.max_new_tokens):
        window = torch.tensor([context[-model.cfg.max_seq_len:]], dtype=torch.long)
        with torch.no_grad():
            logits = model(window)[:, -1, :]
        gen = torch.tensor([new_ids], dtype=torch.long).reshape(1, -1)
        token = int(sample_next_token(logits, params, generator=generator, prompt_ids=prompt,
                                      generated_ids=gen)[0])
        new_ids.append(token)
        context.append(token)
        if eos_id is not None and token == eos_id:
            return new_ids, "eos"
    return new_ids, "length"
'''),
    Alternative('stream_text', 'track shown string', '''
def stream_text(token_ids, decode, stop):
    pieces, shown = [], ""
    for i in range(len(token_ids)):
        text = decode(token_ids[:i + 1])
        n, stopped = safe_text_length(text, stop)
        if stopped:
            pieces.append(text[:n][len(shown):])
            return pieces, True
        if i == len(token_ids) - 1:
            n = len(text)
        pieces.append(text[:n][len(shown):])
        shown = text[:n]
    return pieces, False
'''),
]
