"""Day 19 mistakes: each must lose its exercise's points, and only its own."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

_STEP = '''
def step_dfa(dfa, state, ch):
    code = ord(ch)
    for lo, hi, nxt in dfa.transitions[state]:
        if lo <= code <= hi:
            return nxt
    return None
'''

_WALK = '''
def walk(dfa, state, text):
    for ch in text:
        if state is None:
            return None
        state = step_dfa(dfa, state, ch)
    return state
'''

_ALLOWED = '''
def allowed_tokens(dfa, state, vocab, eos_id):
    allowed = torch.zeros(len(vocab), dtype=torch.bool)
    for token_id, text in enumerate(vocab):
        if text:
            allowed[token_id] = walk(dfa, state, text) is not None
    if eos_id is not None:
        allowed[eos_id] = dfa.accepts(state)
    return allowed
'''

_COUNT = '''
def count_forced(dfa, vocab, eos_id, token_ids):
    state, forced = dfa.start, 0
    for token in token_ids:
        if forced_token(allowed_tokens(dfa, state, vocab, eos_id)) is not None:
            forced += 1
        if token == eos_id:
            break
        state = walk(dfa, state, vocab[token])
    return forced
'''

_FORCED = '''
def forced_token(mask):
    ids = mask.nonzero().flatten().tolist()
    return ids[0] if len(ids) == 1 else None
'''

_SCHEMA = '''
def schema_to_regex(schema):
    scalars = {{"string": JSON_STRING, "integer": {integer}, "boolean": {boolean}}}
    fields = []
    for name, prop in schema["properties"].items():
        if "enum" in prop:
            value = {enum}
        elif prop.get("type") in scalars:
            value = scalars[prop["type"]]
        else:
            raise ValueError(f"field {{name!r}}: unsupported schema {{prop!r}}")
        fields.append(regex_escape(json.dumps(name)) + ":" + value)
    return {braces}
'''


def _schema(integer=r'r"-?(0|[1-9][0-9]*)"', boolean='"(true|false)"',
            enum='"(" + "|".join(regex_escape(json.dumps(v)) for v in prop["enum"]) + ")"',
            braces='r"\\{" + ",".join(fields) + r"\\}"'):
    return _SCHEMA.format(integer=integer, boolean=boolean, enum=enum, braces=braces)


MISTAKES = [
    # ------------------------------------------------------------ step_dfa and walk
    Mistake("walk", "treats hi as exclusive (lo <= code < hi): a one-character range never "
            "matches", _STEP.replace("lo <= code <= hi", "lo <= code < hi") + _WALK,
            says="both ends included"),
    Mistake("walk", "tests the state for truth: the start state 0 counts as dead", _STEP + '''
def walk(dfa, state, text):
    for ch in text:
        if not state:
            return None
        state = step_dfa(dfa, state, ch)
    return state
''', says="start state is 0"),
    Mistake("walk", "does not stop at the dead end: steps on from None", _STEP + '''
def walk(dfa, state, text):
    for ch in text:
        state = step_dfa(dfa, state, ch)
    return state
''', says="dead end"),
    Mistake("walk", "skips a character that has no move instead of dying", _STEP + '''
def walk(dfa, state, text):
    for ch in text:
        if state is None:
            return None
        nxt = step_dfa(dfa, state, ch)
        if nxt is not None:
            state = nxt
    return state
''', says="whatever the later characters are"),
    # ------------------------------------------------------------ the per-token walk
    Mistake("allowed_tokens", "checks only each token's first character", '''
def allowed_tokens(dfa, state, vocab, eos_id):
    allowed = torch.zeros(len(vocab), dtype=torch.bool)
    for token_id, text in enumerate(vocab):
        if text:
            allowed[token_id] = step_dfa(dfa, state, text[0]) is not None
    if eos_id is not None:
        allowed[eos_id] = dfa.accepts(state)
    return allowed
''', says="whole text"),
    Mistake("allowed_tokens", "allows EOS in every state", _ALLOWED.replace(
        "allowed[eos_id] = dfa.accepts(state)", "allowed[eos_id] = True"), says="accepts"),
    Mistake("allowed_tokens", "treats EOS like any token: its text (None) never allows it", '''
def allowed_tokens(dfa, state, vocab, eos_id):
    allowed = torch.zeros(len(vocab), dtype=torch.bool)
    for token_id, text in enumerate(vocab):
        if text:
            allowed[token_id] = walk(dfa, state, text) is not None
    return allowed
''', says="accepts"),
    Mistake("allowed_tokens", "lets EOS through by its text too (|= after the loop): an EOS "
            "whose text walks is allowed where the state does not accept", _ALLOWED.replace(
                "allowed[eos_id] = dfa.accepts(state)", "allowed[eos_id] |= dfa.accepts(state)"),
            says="whatever its text"),
    Mistake("allowed_tokens", "allows a token with an empty text (it walks nowhere, so it "
            "looks alive)", _ALLOWED.replace("if text:", "if text is not None:"),
            says="no text"),
    # ------------------------------------------------------------ masking
    Mistake("mask_logits", "multiplies the logits by the mask (disallowed become 0, not -inf)", '''
def mask_logits(logits, allowed):
    if not allowed.any(dim=-1).all():
        raise ValueError("nothing allowed")
    return logits * allowed
''', says="-inf"),
    Mistake("mask_logits", "masks in place: the caller's logits change", '''
def mask_logits(logits, allowed):
    if not allowed.any(dim=-1).all():
        raise ValueError("nothing allowed")
    return logits.masked_fill_(~allowed, float("-inf"))
''', says="unchanged"),
    Mistake("mask_logits", "no ValueError when nothing is allowed", '''
def mask_logits(logits, allowed):
    return logits.masked_fill(~allowed, float("-inf"))
''', says="ValueError"),
    Mistake("mask_logits", "checks the whole mask, not each row, for an allowed token", '''
def mask_logits(logits, allowed):
    if not allowed.any():
        raise ValueError("nothing allowed")
    return logits.masked_fill(~allowed, float("-inf"))
''', says="row"),
    # ------------------------------------------------------------ masked greedy
    Mistake("masked_greedy", "returns the position among the allowed tokens, not the token id", '''
def masked_greedy(logits, allowed):
    return int(torch.argmax(logits[allowed]))
''', says="whole vocabulary"),
    Mistake("masked_greedy", "multiplies the logits by the mask, so a disallowed 0 beats negative "
            "allowed logits", '''
def masked_greedy(logits, allowed):
    return int(torch.argmax(logits * allowed))
''', says="negative"),
    Mistake("masked_greedy", "ignores the mask", '''
def masked_greedy(logits, allowed):
    return int(torch.argmax(logits))
''', says="allowed one"),
    # ------------------------------------------------------------ forced tokens
    Mistake("forced_tokens", "calls the first allowed token forced even when several are "
            "allowed", '''
def forced_token(mask):
    ids = mask.nonzero().flatten().tolist()
    return ids[0] if ids else None
''' + _COUNT, says="ONLY one"),
    Mistake("forced_tokens", "stops at EOS before counting it", _FORCED + '''
def count_forced(dfa, vocab, eos_id, token_ids):
    state, forced = dfa.start, 0
    for token in token_ids:
        if token == eos_id:
            break
        if forced_token(allowed_tokens(dfa, state, vocab, eos_id)) is not None:
            forced += 1
        state = walk(dfa, state, vocab[token])
    return forced
''', says="final forced EOS"),
    Mistake("forced_tokens", "looks at the mask of the state AFTER each token, not the one it "
            "was chosen in", _FORCED + '''
def count_forced(dfa, vocab, eos_id, token_ids):
    state, forced = dfa.start, 0
    for token in token_ids:
        if token == eos_id:
            break
        state = walk(dfa, state, vocab[token])
        if forced_token(allowed_tokens(dfa, state, vocab, eos_id)) is not None:
            forced += 1
    return forced
''', says="before moving on"),
    Mistake("forced_tokens", "tests the forced id for truth: a forced token with id 0 is not "
            "counted", _FORCED + _COUNT.replace(
                "if forced_token(allowed_tokens(dfa, state, vocab, eos_id)) is not None:",
                "if forced_token(allowed_tokens(dfa, state, vocab, eos_id)):"), says="id 0"),
    # ------------------------------------------------------------ JSON Schema to a pattern
    Mistake("schema_to_regex", "does not group an enum's alternatives: | splits the whole pattern",
            _schema(enum='"|".join(regex_escape(json.dumps(v)) for v in prop["enum"])'),
            says="grouped"),
    Mistake("schema_to_regex", "writes enum values with str(), not as JSON (no quotes, True)",
            _schema(enum='"(" + "|".join(regex_escape(str(v)) for v in prop["enum"]) + ")"'),
            says="JSON texts"),
    Mistake("schema_to_regex", "allows leading zeros in an integer ([0-9]+)",
            _schema(integer='"-?[0-9]+"'), says="leading zeros"),
    Mistake("schema_to_regex", "leaves the braces unescaped: { opens a repeat count",
            _schema(braces='"{" + ",".join(fields) + "}"'), says="subset"),
    Mistake("schema_to_regex", "quotes a field name by hand ('\"' + name + '\"'), not with "
            "json.dumps: a quote or backslash in the name stays bare",
            _schema().replace('fields.append(regex_escape(json.dumps(name)) + ":" + value)',
                              'fields.append(\'"\' + regex_escape(name) + \'":\' + value)'),
            says="json.dumps(name)"),
    # ------------------------------------------------------------ self-checks
    Mistake("q1", "thinks a list of any length needs a stack", 'answer_q1 = "B"\n'),
    Mistake("q2", "gives masking's answer, 0.6 / 0.7", "answer_q2 = 0.6 / 0.7\n"),
    Mistake("q2", "two decimals where the question asks for three", "answer_q2 = 0.38\n",
            says="round your result to three decimals"),
    Mistake("q3", "thinks an accepting state must end the text", 'answer_q3 = "C"\n'),
]

# walk and allowed_tokens are used by later exercises, whose tests swap in the package's
# versions: a bug in them costs only their own exercise.
_KEEPS = {"walk": ("allowed_tokens", "forced_tokens"), "allowed_tokens": ("forced_tokens",),
          "mask_logits": ("masked_greedy",)}
MISTAKES = [replace(m, keeps=_KEEPS.get(m.grade_id, ())) for m in MISTAKES]

EQUIVALENT_MUTANTS = {
    "forced_tokens: return ids[0] if len(ids) == 1 else None => return ids[-1] if len(ids) == 1 "
    "else None":
        "the branch runs only when ids has exactly one element: its first is its last",
}

# Right answers written another way: each must keep full marks.
ALTERNATIVES = [
    Alternative('walk', 'bisect over sorted ranges; recursive walk', """
import bisect
def step_dfa(dfa, state, ch):
    row = dfa.transitions[state]
    c = ord(ch)
    i = bisect.bisect_right([lo for lo, _, _ in row], c) - 1
    if i >= 0 and row[i][0] <= c <= row[i][1]:
        return row[i][2]
    return None

def walk(dfa, state, text):
    if state is None or not text:
        return state
    return walk(dfa, step_dfa(dfa, state, text[0]), text[1:])
"""),
    Alternative('mask_logits', 'where + sum check', """
def mask_logits(logits, allowed):
    if (allowed.sum(dim=-1) == 0).any():
        raise ValueError("a row of allowed has no True entry")
    return torch.where(allowed, logits, torch.full_like(logits, float("-inf")))
"""),
    Alternative('masked_greedy', 'python max', """
def masked_greedy(logits, allowed):
    masked = mask_logits(logits, allowed).tolist()
    return max(range(len(masked)), key=masked.__getitem__)
"""),
    Alternative('forced_tokens', 'nonzero tuple, keyword calls', """
def forced_token(mask):
    (ids,) = torch.nonzero(mask, as_tuple=True)
    return ids.item() if ids.numel() == 1 else None

def count_forced(dfa, vocab, eos_id, token_ids):
    state = dfa.start
    total = 0
    for tok in token_ids:
        mask = allowed_tokens(dfa, state, vocab, eos_id=eos_id)
        total += forced_token(mask) is not None
        if tok == eos_id:
            break
        state = walk(dfa, state, text=vocab[tok])
    return total
"""),
    Alternative('schema_to_regex', 'validate first, enum via set of alternatives', """
def schema_to_regex(schema):
    props = schema["properties"]
    for name, prop in props.items():
        if not ("enum" in prop or prop.get("type") in ("string", "integer", "boolean")):
            raise ValueError(f"field {name!r} has an unsupported schema")
    def value(prop):
        if "enum" in prop:
            return "(" + "|".join(regex_escape(json.dumps(v)) for v in prop["enum"]) + ")"
        return {"string": JSON_STRING, "integer": "(-?(0|[1-9][0-9]*))", "boolean": "(true|false)"}[prop["type"]]
    body = ",".join(f"{regex_escape(json.dumps(n))}:{value(p)}" for n, p in props.items())
    return regex_escape("{") + body + regex_escape("}")
"""),
    Alternative('q2', 'fraction', """
answer_q2 = 3 / 8
"""),
    Alternative('q2', 'three decimals, as asked', """
answer_q2 = 0.375
"""),
    # self-check numbers from numpy / torch (testing.is_number); capitalised messages (str(err).lower())
    Alternative('q2', 'a NumPy float32 from np.round', '''
# Set answer_q2 to a number.
import numpy as np
answer_q2 = np.round(np.float32(0.06) / np.float32(0.06 + 0.1), 3)
'''),
]
