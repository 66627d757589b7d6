"""Day 02 mistakes: each must lose its exercise's points."""

from dataclasses import replace

from autograder.mistakes import Alternative, Mistake

MISTAKES = [
    # ---------------------------------------------------------------- get_pair_counts
    Mistake("get_pair_counts", "counts each distinct pair once (a set of pairs)", """
def get_pair_counts(ids):
    return {pair: 1 for pair in zip(ids, ids[1:])}
"""),
    Mistake("get_pair_counts", "steps by two: misses overlapping pairs", """
def get_pair_counts(ids):
    counts = {}
    for i in range(0, len(ids) - 1, 2):
        pair = (ids[i], ids[i + 1])
        counts[pair] = counts.get(pair, 0) + 1
    return counts
"""),
    Mistake("get_pair_counts", "off by one: forgets the last pair", """
def get_pair_counts(ids):
    counts = {}
    for i in range(len(ids) - 2):
        pair = (ids[i], ids[i + 1])
        counts[pair] = counts.get(pair, 0) + 1
    return counts
"""),
    Mistake("get_pair_counts", "treats pairs as unordered (sorts them)", """
def get_pair_counts(ids):
    counts = {}
    for a, b in zip(ids, ids[1:]):
        pair = (min(a, b), max(a, b))
        counts[pair] = counts.get(pair, 0) + 1
    return counts
"""),
    # ---------------------------------------------------------------- merge_pair
    Mistake("merge_pair", "drops the last id when it has no partner", """
def merge_pair(ids, pair, new_id):
    out, i = [], 0
    while i < len(ids) - 1:
        if ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
"""),
    Mistake("merge_pair", "overlapping matches: [5, 5, 5] becomes [9, 9]", """
def merge_pair(ids, pair, new_id):
    out = []
    for i in range(len(ids)):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == tuple(pair):
            out.append(new_id)
        elif i > 0 and (ids[i - 1], ids[i]) == tuple(pair):
            continue
        else:
            out.append(ids[i])
    return out
"""),
    Mistake("merge_pair", "edits the input list in place", """
def merge_pair(ids, pair, new_id):
    i = 0
    while i < len(ids) - 1:
        if ids[i] == pair[0] and ids[i + 1] == pair[1]:
            ids[i:i + 2] = [new_id]
        i += 1
    return ids
"""),
    Mistake("merge_pair", "replaces only the first occurrence", """
def merge_pair(ids, pair, new_id):
    for i in range(len(ids) - 1):
        if ids[i] == pair[0] and ids[i + 1] == pair[1]:
            return list(ids[:i]) + [new_id] + list(ids[i + 2:])
    return list(ids)
"""),
    # ---------------------------------------------------------------- train_bpe
    Mistake("train_bpe", "ties go to the pair seen first (max over dict order)", """
def train_bpe(text, num_merges):
    chunks = [list(chunk.encode("utf-8")) for chunk in pretokenize(text)]
    merges = {}
    for k in range(num_merges):
        counts = {}
        for ids in chunks:
            for pair, n in get_pair_counts(ids).items():
                counts[pair] = counts.get(pair, 0) + n
        if not counts:
            break
        best = max(counts, key=counts.get)
        merges[best] = 256 + k
        chunks = [merge_pair(ids, best, 256 + k) for ids in chunks]
    return merges
"""),
    Mistake("train_bpe", "ties go to the largest pair", """
def train_bpe(text, num_merges):
    chunks = [list(chunk.encode("utf-8")) for chunk in pretokenize(text)]
    merges = {}
    for k in range(num_merges):
        counts = {}
        for ids in chunks:
            for pair, n in get_pair_counts(ids).items():
                counts[pair] = counts.get(pair, 0) + n
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], p))
        merges[best] = 256 + k
        chunks = [merge_pair(ids, best, 256 + k) for ids in chunks]
    return merges
"""),
    Mistake("train_bpe", "no pre-tokenization: merges cross word boundaries", """
def train_bpe(text, num_merges):
    ids = list(text.encode("utf-8"))
    merges = {}
    for k in range(num_merges):
        counts = get_pair_counts(ids)
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges[best] = 256 + k
        ids = merge_pair(ids, best, 256 + k)
    return merges
"""),
    Mistake("train_bpe", "new ids start at 255 instead of 256", """
def train_bpe(text, num_merges):
    chunks = [list(chunk.encode("utf-8")) for chunk in pretokenize(text)]
    merges = {}
    for k in range(num_merges):
        counts = {}
        for ids in chunks:
            for pair, n in get_pair_counts(ids).items():
                counts[pair] = counts.get(pair, 0) + n
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges[best] = 255 + k
        chunks = [merge_pair(ids, best, 255 + k) for ids in chunks]
    return merges
"""),
    Mistake("train_bpe", "counts pairs once but never applies the merge to the chunks", """
def train_bpe(text, num_merges):
    chunks = [list(chunk.encode("utf-8")) for chunk in pretokenize(text)]
    counts = {}
    for ids in chunks:
        for pair, n in get_pair_counts(ids).items():
            counts[pair] = counts.get(pair, 0) + n
    ranked = sorted(counts, key=lambda p: (-counts[p], p))[:num_merges]
    return {pair: 256 + k for k, pair in enumerate(ranked)}
"""),
    Mistake("train_bpe", "crashes on max() of no pairs instead of stopping early", """
def train_bpe(text, num_merges):
    chunks = [list(chunk.encode("utf-8")) for chunk in pretokenize(text)]
    merges = {}
    for k in range(num_merges):
        counts = {}
        for ids in chunks:
            for pair, n in get_pair_counts(ids).items():
                counts[pair] = counts.get(pair, 0) + n
        best = min(counts, key=lambda p: (-counts[p], p))
        merges[best] = 256 + k
        chunks = [merge_pair(ids, best, 256 + k) for ids in chunks]
    return merges
""", says="an empty min()/max()"),
    # ---------------------------------------------------------------- encode
    Mistake("encode", "merges the leftmost mergeable pair first, not the lowest rank", """
def encode(text, merges):
    out = []
    for chunk in pretokenize(text):
        ids = list(chunk.encode("utf-8"))
        while True:
            pair = next((p for p in zip(ids, ids[1:]) if p in merges), None)
            if pair is None:
                break
            ids = merge_pair(ids, pair, merges[pair])
        out.extend(ids)
    return out
""", says="leftmost mergeable pair is not the rule"),
    Mistake("encode", "merges the highest rank first", """
def encode(text, merges):
    out = []
    for chunk in pretokenize(text):
        ids = list(chunk.encode("utf-8"))
        while len(ids) >= 2:
            pair = max(zip(ids, ids[1:]), key=lambda p: merges.get(p, -1))
            if pair not in merges:
                break
            ids = merge_pair(ids, pair, merges[pair])
        out.extend(ids)
    return out
""", says="lowest new id"),
    Mistake("encode", "no pre-tokenization: merges across chunk boundaries", """
def encode(text, merges):
    ids = list(text.encode("utf-8"))
    while len(ids) >= 2:
        pair = min(zip(ids, ids[1:]), key=lambda p: merges.get(p, float("inf")))
        if pair not in merges:
            break
        ids = merge_pair(ids, pair, merges[pair])
    return ids
"""),
    Mistake("encode", "code points (ord) instead of UTF-8 bytes", """
def encode(text, merges):
    out = []
    for chunk in pretokenize(text):
        ids = [ord(c) for c in chunk]
        while len(ids) >= 2:
            pair = min(zip(ids, ids[1:]), key=lambda p: merges.get(p, float("inf")))
            if pair not in merges:
                break
            ids = merge_pair(ids, pair, merges[pair])
        out.extend(ids)
    return out
"""),
    Mistake("encode", "a single pass: stops after the first merge of each chunk", """
def encode(text, merges):
    out = []
    for chunk in pretokenize(text):
        ids = list(chunk.encode("utf-8"))
        if len(ids) >= 2:
            pair = min(zip(ids, ids[1:]), key=lambda p: merges.get(p, float("inf")))
            if pair in merges:
                ids = merge_pair(ids, pair, merges[pair])
        out.extend(ids)
    return out
""", says="one pass is not enough"),
    # ---------------------------------------------------------------- decode
    Mistake("decode", "decodes each token on its own (breaks characters split over tokens)", """
def build_vocab(merges):
    vocab = {i: bytes([i]) for i in range(256)}
    for (left, right), new_id in merges.items():
        vocab[new_id] = vocab[left] + vocab[right]
    return vocab


def decode(ids, merges):
    vocab = build_vocab(merges)
    return "".join(vocab[i].decode("utf-8", errors="replace") for i in ids)
"""),
    Mistake("decode", "strict UTF-8: raises on half a character", """
def build_vocab(merges):
    vocab = {i: bytes([i]) for i in range(256)}
    for (left, right), new_id in merges.items():
        vocab[new_id] = vocab[left] + vocab[right]
    return vocab


def decode(ids, merges):
    vocab = build_vocab(merges)
    return b"".join(vocab[i] for i in ids).decode("utf-8")
"""),
    Mistake("decode", "errors='ignore': silently drops broken bytes", """
def build_vocab(merges):
    vocab = {i: bytes([i]) for i in range(256)}
    for (left, right), new_id in merges.items():
        vocab[new_id] = vocab[left] + vocab[right]
    return vocab


def decode(ids, merges):
    vocab = build_vocab(merges)
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="ignore")
"""),
    Mistake("decode", "chr() of each byte (Latin-1), not UTF-8", """
def build_vocab(merges):
    vocab = {i: bytes([i]) for i in range(256)}
    for (left, right), new_id in merges.items():
        vocab[new_id] = vocab[left] + vocab[right]
    return vocab


def decode(ids, merges):
    vocab = build_vocab(merges)
    return "".join(chr(b) for i in ids for b in vocab[i])
"""),
    Mistake("decode", "builds merged tokens right part first", """
def build_vocab(merges):
    vocab = {i: bytes([i]) for i in range(256)}
    for (left, right), new_id in merges.items():
        vocab[new_id] = vocab[right] + vocab[left]
    return vocab


def decode(ids, merges):
    vocab = build_vocab(merges)
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")
"""),
    # ---------------------------------------------------------------- encode_chat
    Mistake("encode_chat", "renders the template and encodes it with every special allowed", """
ROLES = ("system", "user", "assistant")


def encode_chat(messages, tok, add_generation_prompt=True):
    text = ""
    for message in messages:
        if message["role"] not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {message['role']!r}")
        text += f"<|{message['role']}|>{message['content']}<|end|>"
    if add_generation_prompt:
        text += "<|assistant|>"
    return tok.encode(text, allowed_special="all")
"""),
    Mistake("encode_chat", "no role check: an unknown role gives a KeyError", """
def encode_chat(messages, tok, add_generation_prompt=True):
    special = tok.special_tokens
    ids = []
    for message in messages:
        ids.append(special[f"<|{message['role']}|>"])
        ids.extend(tok.encode(message["content"]))
        ids.append(special["<|end|>"])
    if add_generation_prompt:
        ids.append(special["<|assistant|>"])
    return ids
"""),
    Mistake("encode_chat", "checks the role by looking its marker up in tok.special_tokens", """
ROLES = ("system", "user", "assistant")


def encode_chat(messages, tok, add_generation_prompt=True):
    special = tok.special_tokens
    ids = []
    for message in messages:
        role = message["role"]
        marker = f"<|{role}|>"
        if marker not in special:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        ids.append(special[marker])
        ids.extend(tok.encode(message["content"]))
        ids.append(special["<|end|>"])
    if add_generation_prompt:
        ids.append(special["<|assistant|>"])
    return ids
""", says="not against tok.special_tokens"),
    Mistake("encode_chat", "forgets the generation prompt", """
ROLES = ("system", "user", "assistant")


def encode_chat(messages, tok, add_generation_prompt=True):
    special = tok.special_tokens
    ids = []
    for message in messages:
        if message["role"] not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {message['role']!r}")
        ids.append(special[f"<|{message['role']}|>"])
        ids.extend(tok.encode(message["content"]))
        ids.append(special["<|end|>"])
    return ids
"""),
    Mistake("encode_chat", "lower-cases the role, accepting 'User'", """
ROLES = ("system", "user", "assistant")


def encode_chat(messages, tok, add_generation_prompt=True):
    special = tok.special_tokens
    ids = []
    for message in messages:
        role = message["role"].lower()
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        ids.append(special[f"<|{role}|>"])
        ids.extend(tok.encode(message["content"]))
        ids.append(special["<|end|>"])
    if add_generation_prompt:
        ids.append(special["<|assistant|>"])
    return ids
"""),
    Mistake("encode_chat", "the generation prompt after every message", """
ROLES = ("system", "user", "assistant")


def encode_chat(messages, tok, add_generation_prompt=True):
    special = tok.special_tokens
    ids = []
    for message in messages:
        if message["role"] not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {message['role']!r}")
        ids.append(special[f"<|{message['role']}|>"])
        ids.extend(tok.encode(message["content"]))
        ids.append(special["<|end|>"])
        if add_generation_prompt:
            ids.append(special["<|assistant|>"])
    return ids
"""),
    # ---------------------------------------------------------------- to_tiktoken
    Mistake("to_tiktoken", "ranks hold only the merged tokens, not the 256 bytes", """
def to_tiktoken(merges, special_tokens=None):
    vocab = build_vocab(merges)
    ranks = {vocab[new_id]: new_id for new_id in merges.values()}
    return tiktoken.Encoding(name="day02_bpe", pat_str=GPT4_SPLIT_PATTERN,
                             mergeable_ranks=ranks, special_tokens=dict(special_tokens or {}))
"""),
    Mistake("to_tiktoken", "a different split pattern (whitespace / non-whitespace runs)", """
def to_tiktoken(merges, special_tokens=None):
    ranks = {token: i for i, token in build_vocab(merges).items()}
    return tiktoken.Encoding(name="day02_bpe", pat_str=r"\\s+|\\S+",
                             mergeable_ranks=ranks, special_tokens=dict(special_tokens or {}))
"""),
    Mistake("to_tiktoken", "ignores the special tokens", """
def to_tiktoken(merges, special_tokens=None):
    ranks = {token: i for i, token in build_vocab(merges).items()}
    return tiktoken.Encoding(name="day02_bpe", pat_str=GPT4_SPLIT_PATTERN,
                             mergeable_ranks=ranks, special_tokens={})
"""),
    Mistake("to_tiktoken", "ranks by sorted bytes instead of by id", """
def to_tiktoken(merges, special_tokens=None):
    tokens = sorted(build_vocab(merges).values())
    ranks = {token: i for i, token in enumerate(tokens)}
    return tiktoken.Encoding(name="day02_bpe", pat_str=GPT4_SPLIT_PATTERN,
                             mergeable_ranks=ranks, special_tokens=dict(special_tokens or {}))
"""),
    # ---------------------------------------------------------------- self-check
    Mistake("q1", "counts characters instead of UTF-8 bytes", "answer_q1 = 7"),
    Mistake("q1", "counts ï as one byte", "answer_q1 = 10"),
    Mistake("q2", "thinks the leftmost pair goes first", 'answer_q2 = "A"'),
    Mistake("q2", "thinks the most frequent pair in the new text goes first", 'answer_q2 = "C"'),
    Mistake("q3", "thinks the special id is produced", 'answer_q3 = "A"'),
    Mistake("q3", "thinks the encoder raises, as tiktoken's encode does by default",
            'answer_q3 = "C"'),
    Mistake("q4", "forgets the special tokens", "answer_q4 = 768"),
    Mistake("q4", "forgets the 256 byte tokens", "answer_q4 = 1019"),
]

# One mistake, one charge: the later exercises' tests swap in the package's version of
# the function these mistakes break, so they keep their full marks (by name prefix).
_KEEPS = {
    'off by one: forgets the last pair': ('train_bpe',),
    'replaces only the first occurrence': ('train_bpe', 'encode'),
    # encode's and decode's tests use the package's merges of the story, not the MERGES
    # a data cell learns with the student's train_bpe (a data cell runs the right answer in
    # the proofs, so this covers the test cells; see the day's run_full check)
    'new ids start at 255 instead of 256': ('encode', 'decode'),
    # to_tiktoken's test swaps in the package's vocabulary for build_vocab
    'builds merged tokens right part first': ('to_tiktoken',),
}
MISTAKES = [replace(m, keeps=next((v for k, v in _KEEPS.items() if m.name.startswith(k)), ()))
            for m in MISTAKES]

# Mutants (autograder/mutants.py) that compute the same thing as the solution.
EQUIVALENT_MUTANTS = {
    'train_bpe: counts[pair] = counts.get(pair, 0) + n => counts[pair] = counts.get(pair, 1) + n':
        "every pair's count moves by the same constant: the most frequent pair and the tie order do not change",
    'train_bpe: counts[pair] = counts.get(pair, 0) + n => counts[pair] = counts.get(pair, -1) + n':
        "every pair's count moves by the same constant: the most frequent pair and the tie order do not change",
}

# Right answers written another way: each must keep full marks (tests/test_grading_proofs.py).
ALTERNATIVES = [
    Alternative('get_pair_counts', 'Counter', '''
from collections import Counter
def get_pair_counts(ids):
    return Counter(zip(ids, ids[1:]))
'''),
    Alternative('merge_pair', 'for-loop with skip flag', '''
def merge_pair(ids, pair, new_id):
    out, skip = [], False
    for i, t in enumerate(ids):
        if skip:
            skip = False
            continue
        if i + 1 < len(ids) and (t, ids[i + 1]) == tuple(pair):
            out.append(new_id)
            skip = True
        else:
            out.append(t)
    return out
'''),
    Alternative('train_bpe', 'distinct chunks with weights', '''
from collections import Counter
def train_bpe(text, num_merges):
    chunk_counts = Counter(pretokenize(text))
    chunks = {c: list(c.encode("utf-8")) for c in chunk_counts}
    merges = {}
    new_id = 256
    while len(merges) < num_merges:
        counts = {}
        for c, ids in chunks.items():
            for pair, n in get_pair_counts(ids).items():
                counts[pair] = counts.get(pair, 0) + n * chunk_counts[c]
        if not counts:
            break
        top = max(counts.values())
        best = min(p for p, n in counts.items() if n == top)
        merges[best] = new_id
        chunks = {c: merge_pair(ids, best, new_id) for c, ids in chunks.items()}
        new_id += 1
    return merges
'''),
    Alternative('encode', 'loop over merges by rank, guard', '''
def encode(text, merges):
    out = []
    for chunk in pretokenize(text):
        ids = list(chunk.encode("utf-8"))
        while len(ids) > 1:
            ranked = [(merges[p], p) for p in zip(ids, ids[1:]) if p in merges]
            if not ranked:
                break
            rank, pair = min(ranked)
            ids = merge_pair(ids, pair, rank)
        out += ids
    return out
'''),
    Alternative('decode', 'bytearray vocab, .get', '''
def build_vocab(merges):
    vocab = {i: bytes([i]) for i in range(256)}
    for (a, b), i in merges.items():
        vocab[i] = vocab[a] + vocab[b]
    return vocab

def decode(ids, merges):
    vocab = build_vocab(merges)
    buf = bytearray()
    for i in ids:
        buf += vocab[i]
    return bytes(buf).decode("utf-8", errors="replace")
'''),
    Alternative('encode_chat', 'validate all first, message lists roles', '''
ROLES = ("system", "user", "assistant")

def encode_chat(messages, tok, add_generation_prompt=True):
    for m in messages:
        if m["role"] not in ROLES:
            raise ValueError(f"unknown role {m['role']!r}; allowed roles: {', '.join(ROLES)}")
    ids = []
    for m in messages:
        ids += [tok.special_tokens["<|" + m["role"] + "|>"], *tok.encode(m["content"]),
                tok.special_tokens["<|end|>"]]
    if add_generation_prompt:
        ids.append(tok.special_tokens["<|assistant|>"])
    return ids
'''),
    Alternative('to_tiktoken', 'ranks built directly', '''
def to_tiktoken(merges, special_tokens=None):
    vocab = build_vocab(merges)
    ranks = {}
    for i in sorted(vocab):
        ranks[vocab[i]] = i
    return tiktoken.Encoding(name="day02_bpe", pat_str=GPT4_SPLIT_PATTERN,
                             mergeable_ranks=ranks,
                             special_tokens={} if special_tokens is None else special_tokens)
'''),
]
