"""Day 19: constrained decoding. Make every generated text match a pattern, token by token.

Applications often need text of a fixed shape: JSON with given fields, a date, yes or no.
Constrained decoding leaves the model free only among the texts that can still become a match:
before each token is sampled, every token that would make a match impossible gets logit -inf.
The pattern is compiled once into a deterministic finite automaton (DFA): its state sums up the
text so far, each character moves it to a next state or to the dead end, and a state accepts
when the text so far is a complete match. The pieces, in the order the day builds them:

    compile_regex     pattern -> tree -> Thompson NFA (small graphs joined by empty moves) ->
                      DFA by the subset construction. Transitions are character RANGES
                      (lo, hi, next), not one entry per Unicode character
    allowed_tokens    the oracle: walk each token's text through the DFA; a token is allowed
                      when all its characters keep the text alive (one token usually crosses
                      several transitions); EOS is allowed exactly in accepting states
    VocabTrie         the same answer from a character trie of the vocabulary, walked once per
                      state: a shared prefix is walked once, a dead branch skipped whole
    TokenIndex        each state's mask, computed once and kept (outlines' index idea)
    mask_logits       disallowed tokens -> -inf; a mask that allows nothing is an error
    constrained_generate  the generate loop with a mask before each sample. A token that is the
                      only one allowed is appended without sampling ("forced"), and the model
                      reads a run of forced tokens in ONE forward pass
    schema_to_regex   a small JSON Schema subset -> a regex of the subset (no whitespace)
    token_strings     each token id's text, as the walk needs it

The regex subset: literals; escapes \\. \\\\ \\" (backslash + any punctuation), \\d \\w \\s
\\D \\W \\S, \\n \\t \\r \\f \\v, \\xHH; '.' (anything but a newline); classes [a-z0-9_] and [^"];
groups ( ) and (?: ); '|'; '*', '+', '?'; {m}, {m,}, {m,n}. Anything else is a ValueError that
names the position; a pattern that matches no string at all is a ValueError too (its start
would be the dead end). The whole text must match (re.fullmatch), so there are no anchors, and
\\d \\w \\s are ASCII only, as with re.ASCII (JSON's digits are 0-9).

Bounds: a DFA can need exponentially many states ('(a|b)*a(a|b){20}' remembers the last 21
letters: over two million), so compile_regex stops with a ValueError at max_states; repeat
counts are at most MAX_REPEAT and the NFA at most MAX_NFA_STATES states.
"""

from __future__ import annotations

import bisect
import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from tinygpt.generate import (
    GenerationResult,
    last_token_logits,
    model_device,
    model_limits,
    prepare_prompt,
)
from tinygpt.kv_cache import DecodeStep, KVCache, prefill, supports_kv_cache
from tinygpt.native import torch_single_thread
from tinygpt.sampling import SamplingParams, check_token_id, sample_next_token

MAX_CHAR = 0x10FFFF           # the last Unicode code point
MAX_REPEAT = 1000             # the largest m or n of {m,n}
MAX_NFA_STATES = 200_000
SUBSET = ("literals; escapes \\. \\\\ \\\" (backslash + punctuation), \\d \\w \\s \\D \\W \\S, "
          "\\n \\t \\r \\f \\v, \\xHH; '.'; classes [a-z] and [^a-z]; groups ( ) and (?: ); '|'; "
          "'*', '+', '?'; {m}, {m,} and {m,n}")
Ranges = tuple[tuple[int, int], ...]   # sorted, disjoint, inclusive code-point ranges


def _normalize(pairs) -> Ranges:
    """Sort inclusive (lo, hi) pairs and merge those that overlap or touch."""
    out: list[list[int]] = []
    for lo, hi in sorted(pairs):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _negate(ranges: Ranges) -> Ranges:
    """Every code point NOT in `ranges`."""
    out, lo = [], 0
    for a, b in ranges:
        if a > lo:
            out.append((lo, a - 1))
        lo = b + 1
    return tuple(out + [(lo, MAX_CHAR)] if lo <= MAX_CHAR else out)


def _char(c: str) -> Ranges:
    return ((ord(c), ord(c)),)


DIGIT, SPACE = ((48, 57),), ((9, 13), (32, 32))
WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE,
                 "D": _negate(DIGIT), "W": _negate(WORD), "S": _negate(SPACE)}
CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
DOT = _negate(_char("\n"))
DIGITS, HEX = frozenset("0123456789"), frozenset("0123456789abcdefABCDEF")
QUANTIFIERS = frozenset("*+?{")


# ----------------------------------------------------------------------------------------------
# Parsing: pattern -> tree, whose nodes are tuples
#   ("set", ranges)   ("cat", children)   ("alt", children)   ("rep", child, min, max or None)
# ----------------------------------------------------------------------------------------------

class _Parser:
    """Recursive descent: alternation > sequence > repeat > atom, one method per level."""

    def __init__(self, pattern: str) -> None:
        self.p, self.i = pattern, 0

    def fail(self, what: str, at: int | None = None):
        at = self.i if at is None else at
        raise ValueError(f"regex {self.p!r}, position {at}: {what}. The subset allows {SUBSET}")

    def peek(self) -> str:
        return self.p[self.i] if self.i < len(self.p) else ""

    def parse(self):
        node = self.alternation()
        if self.i < len(self.p):               # alternation stops early only at a ')'
            self.fail("unmatched ')'")
        return node

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", tuple(branches))

    def sequence(self):
        items = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.repeat())
        return items[0] if len(items) == 1 else ("cat", tuple(items))

    def repeat(self):
        node = self.atom()
        if self.peek() in QUANTIFIERS:
            node = ("rep", node, *self.quantifier())
            if self.peek() in QUANTIFIERS:
                self.fail("a quantifier cannot follow another (lazy and possessive forms are not "
                          "in the subset): wrap the repeat in ( ) first")
        return node

    def quantifier(self) -> tuple[int, int | None]:
        at, c = self.i, self.p[self.i]
        self.i += 1
        if c != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        lo = hi = self.number()
        if self.peek() == ",":
            self.i += 1
            hi = None if self.peek() == "}" else self.number()
        if self.peek() != "}":
            self.fail("a bounded repeat is {m}, {m,} or {m,n}; write \\{ for a literal brace", at)
        self.i += 1
        if hi is not None and hi < lo:
            self.fail(f"{{m,n}} needs m <= n, got {{{lo},{hi}}}", at)
        return lo, hi

    def number(self) -> int:
        start = self.i
        while self.peek() in DIGITS:
            self.i += 1
        if start == self.i:
            self.fail("expected a repeat count (digits)")
        if int(self.p[start:self.i]) > MAX_REPEAT:
            self.fail(f"repeat counts must be <= MAX_REPEAT = {MAX_REPEAT}", start)
        return int(self.p[start:self.i])

    def atom(self):
        at, c = self.i, self.peek()
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                self.fail("of the (? forms only the group (?: ) is in the subset", at)
            node = self.alternation()
            if self.peek() != ")":
                self.fail("'(' is never closed", at)
            self.i += 1
            return node
        if c in QUANTIFIERS:
            self.fail(f"{c!r} has nothing to repeat", at)
        if c in "^$":
            self.fail("anchors ^ and $ are not in the subset (the whole text must match)", at)
        if c == "[":
            return ("set", self.char_class(at))
        return ("set", DOT if c == "." else self.escape(at) if c == "\\" else _char(c))

    def escape(self, at: int) -> Ranges:
        c = self.peek()
        self.i += 1
        if c in CLASS_ESCAPES:
            return CLASS_ESCAPES[c]
        if c in CONTROL_ESCAPES:
            return _char(CONTROL_ESCAPES[c])
        if c == "x":
            digits, self.i = self.p[self.i:self.i + 2], self.i + 2
            if len(digits) != 2 or not set(digits) <= HEX:
                self.fail("\\x needs exactly two hex digits", at)
            return _char(chr(int(digits, 16)))
        if c and c.isascii() and not c.isalnum():
            return _char(c)
        self.fail(f"unknown escape \\{c}" if c else "the pattern ends with a lone backslash", at)

    def char_class(self, at: int) -> Ranges:
        negate = self.peek() == "^"
        self.i += negate
        pairs, first = [], True
        while self.peek() != "]" or first:       # a ']' right after '[' or '[^' is a literal
            if not self.peek():
                self.fail("'[' is never closed", at)
            first, item_at = False, self.i
            low = self.class_item()
            if self.peek() == "-" and self.p[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                high = self.class_item()
                if len(low) + len(high) != 2 or low[0][0] != low[0][1] \
                        or high[0][0] != high[0][1]:
                    self.fail("a range needs one character at each end", item_at)
                if high[0][0] < low[0][0]:
                    self.fail("a range must go from low to high", item_at)
                low = ((low[0][0], high[0][0]),)
            pairs.extend(low)
        self.i += 1
        return _negate(_normalize(pairs)) if negate else _normalize(pairs)

    def class_item(self) -> Ranges:
        at, c = self.i, self.peek()
        self.i += 1
        return self.escape(at) if c == "\\" else _char(c)


# ----------------------------------------------------------------------------------------------
# Thompson NFA, then the subset construction
# ----------------------------------------------------------------------------------------------

class _NFA:
    """States 0, 1, ...; eps[s]: empty moves; edges[s]: (ranges, target) moves on a character.
    build(node) returns a fragment (start, end): the paths from start to end spell the node's
    language, and end has no moves yet when it is returned."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[Ranges, int]]] = []

    def new(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise ValueError(f"regex {self.pattern!r} needs more than MAX_NFA_STATES = "
                             f"{MAX_NFA_STATES} NFA states (nested repeats multiply)")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def chain(self, end: int, node) -> int:
        """Append a fresh copy of `node` after state `end`; return the new end."""
        start, new_end = self.build(node)
        self.eps[end].append(start)
        return new_end

    def build(self, node) -> tuple[int, int]:
        kind = node[0]
        start = end = self.new()
        if kind == "set":
            end = self.new()
            self.edges[start].append((node[1], end))
        elif kind == "cat":
            for child in node[1]:
                end = self.chain(end, child)
        elif kind == "alt":
            end = self.new()
            for child in node[1]:
                self.eps[self.chain(start, child)].append(end)
        else:                                     # "rep": min copies, then the optional rest
            _, child, lo, hi = node
            for _ in range(lo):
                end = self.chain(end, child)
            final = self.new()
            if hi is None:                        # a star: loop back, or leave
                loop_start, loop_end = self.build(child)
                self.eps[end] += [loop_start, final]
                self.eps[loop_end] += [loop_start, final]
                return start, final
            for _ in range(hi - lo):              # each optional copy may jump to the end
                self.eps[end].append(final)
                end = self.chain(end, child)
            self.eps[end].append(final)
            end = final
        return start, end

    def closure(self, states) -> frozenset[int]:
        """Every state reachable from `states` by empty moves (the states included)."""
        seen, stack = set(states), list(states)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)


def _determinize(nfa: _NFA, start: int, accept: int, max_states: int):
    """Subset construction. A DFA state is a closed set of NFA states. The alphabet is cut at
    every boundary of the outgoing ranges, so each piece [a, b) acts as ONE character.
    Returns (rows, accepting): rows[d] lists (lo, hi, next), adjacent pieces merged."""
    sets = [nfa.closure([start])]
    number = {sets[0]: 0}
    rows: list[list[tuple[int, int, int]]] = []
    while len(rows) < len(sets):
        moves = [move for s in sets[len(rows)] for move in nfa.edges[s]]
        cuts = sorted({c for ranges, _ in moves for lo, hi in ranges for c in (lo, hi + 1)})
        row: list[tuple[int, int, int]] = []
        for a, b in pairwise(cuts):
            targets = [t for ranges, t in moves if any(lo <= a <= hi for lo, hi in ranges)]
            if not targets:
                continue
            target = nfa.closure(targets)
            if target not in number:
                if len(sets) >= max_states:
                    raise ValueError(f"regex {nfa.pattern!r} needs more than max_states = "
                                     f"{max_states} DFA states; simplify it or raise max_states")
                number[target] = len(sets)
                sets.append(target)
            if row and row[-1][2] == number[target] and row[-1][1] == a - 1:
                row[-1] = (row[-1][0], b - 1, number[target])
            else:
                row.append((a, b - 1, number[target]))
        rows.append(row)
    return rows, [accept in s for s in sets]


class DFA:
    """A compiled pattern. States are ints 0 .. num_states - 1; `start` is 0.

    transitions[s] lists (lo, hi, next): a character with code point in [lo, hi] goes to next.
    Moves into states from which no accepting state can be reached are dropped, so step()
    returns None exactly when the text can no longer become a match (the dead end).
    """

    def __init__(self, pattern: str, rows, accepting: list[bool]) -> None:
        self.pattern, self.start, self._accepting = pattern, 0, accepting
        into: list[list[int]] = [[] for _ in rows]         # live: search back from accepting
        for s, row in enumerate(rows):
            for _, _, t in row:
                into[t].append(s)
        self._live, stack = list(accepting), [s for s, ok in enumerate(accepting) if ok]
        while stack:
            for s in into[stack.pop()]:
                if not self._live[s]:
                    self._live[s] = True
                    stack.append(s)
        self.transitions = [[(lo, hi, t) for lo, hi, t in row if self._live[t]] for row in rows]
        self._starts = [[lo for lo, _, _ in row] for row in self.transitions]
        self._memo: list[dict[str, int | None]] = [{} for _ in rows]  # state -> {char: next}
        # every boundary of every state's ranges: characters between two cuts act the same
        self._cuts = sorted({0} | {c for row in self.transitions for lo, hi, _ in row
                                   for c in (lo, hi + 1) if c <= MAX_CHAR})

    def __repr__(self) -> str:
        return f"DFA(pattern={self.pattern!r}, num_states={self.num_states})"

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    def check_state(self, state) -> int:
        if isinstance(state, bool) or not isinstance(state, int) \
                or not 0 <= state < self.num_states:
            raise ValueError(f"state must be an int in [0, {self.num_states}), got {state!r}")
        return state

    def _step(self, state: int, ch: str) -> int | None:
        memo = self._memo[state]
        if ch not in memo:
            code, row = ord(ch), self.transitions[state]
            k = bisect.bisect_right(self._starts[state], code) - 1
            memo[ch] = row[k][2] if k >= 0 and code <= row[k][1] else None
        return memo[ch]

    def step(self, state: int, ch: str) -> int | None:
        """The state after one character `ch`, or None (dead: no match is possible any more)."""
        if not isinstance(ch, str) or len(ch) != 1:
            raise ValueError(f"ch must be a single character, got {ch!r}")
        return self._step(self.check_state(state), ch)

    def walk(self, state: int | None, text: str) -> int | None:
        """The state after all of `text` from `state`, or None once dead (or if state is)."""
        if state is not None:
            self.check_state(state)
        for ch in text:
            if state is None:
                break
            state = self._step(state, ch)
        return state

    def accepts(self, state: int) -> bool:
        """True when the text that led to `state` is a complete match."""
        return self._accepting[self.check_state(state)]

    def live(self, state: int) -> bool:
        """True when some continuation of the text (maybe the empty one) is a match."""
        return self._live[self.check_state(state)]

    def fullmatch(self, text: str) -> bool:
        """The same as re.fullmatch(pattern, text, re.ASCII) is not None."""
        state = self.walk(self.start, text)
        return state is not None and self._accepting[state]

    def representative(self, ch: str) -> str:
        """The first character of ch's class: no transition tells the class's characters apart."""
        return chr(self._cuts[bisect.bisect_right(self._cuts, ord(ch)) - 1])


def compile_regex(pattern: str, max_states: int = 10_000) -> DFA:
    """Pattern (the subset in the module docstring) -> DFA. ValueError for a pattern outside
    the subset (naming the position), for one that matches no string at all (such as
    '[^\\s\\S]': every state of its DFA would be the dead end, the start included), or when
    the DFA would need more than max_states states."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
    if isinstance(max_states, bool) or not isinstance(max_states, int) or max_states < 1:
        raise ValueError(f"max_states must be an int >= 1, got {max_states!r}")
    nfa = _NFA(pattern)
    start, accept = nfa.build(_Parser(pattern).parse())
    dfa = DFA(pattern, *_determinize(nfa, start, accept, max_states))
    if not dfa.live(dfa.start):
        raise ValueError(f"regex {pattern!r} matches no string: no text, not even the empty one, "
                         f"can ever become a match, so a mask from it would allow nothing")
    return dfa


# ----------------------------------------------------------------------------------------------
# The vocabulary walk and the mask
# ----------------------------------------------------------------------------------------------

def _mask(allowed: list[int], size: int, dfa: DFA, state: int, eos_id) -> torch.Tensor:
    check_token_id("eos_id", eos_id, size, optional=True)
    with torch_single_thread():            # tinygpt.native says why (an OpenMP team's wake-up)
        mask = torch.zeros(size, dtype=torch.bool)
        mask[torch.tensor(allowed, dtype=torch.long)] = True
    if eos_id is not None:
        mask[eos_id] = dfa.accepts(state)   # EOS ends the text: only a complete match may end
    return mask


def allowed_tokens(dfa: DFA, state: int, vocab: Sequence[str | None],
                   eos_id: int | None = None) -> torch.Tensor:
    """The oracle: walk every token's text from `state`, one token after another.

    vocab[i] is token i's text (token_strings); None or "" is never allowed. A token is allowed
    when its whole text keeps the DFA alive; eos_id (if given) exactly when `state` accepts.
    Returns a (len(vocab),) bool tensor.
    """
    dfa.check_state(state)
    ok = []
    for token_id, text in enumerate(vocab):
        end = dfa.walk(state, text) if text else None
        if end is not None and dfa.live(end):
            ok.append(token_id)
    return _mask(ok, len(vocab), dfa, state, eos_id)


class VocabTrie:
    """The token texts as a character trie: node = (children {char: node}, ids ending here).
    Tokens whose text is None or "" are left out (never allowed).

    With `dfa`, each character is stored as its class's representative (DFA.representative):
    the walk cannot tell them apart anyway, and the trie shrinks (for '"[^"]*"' SmolLM2's 100k
    nodes become 262). Such a trie only serves that DFA.
    """

    def __init__(self, vocab: Sequence[str | None], dfa: DFA | None = None) -> None:
        self.size, self.dfa = len(vocab), dfa
        self.root: tuple[dict, list[int]] = ({}, [])
        key: dict[str, str] = {}
        for token_id, text in enumerate(vocab):
            node = self.root
            for ch in text or "":
                if dfa is not None:
                    ch = key[ch] if ch in key else key.setdefault(ch, dfa.representative(ch))
                if ch not in node[0]:
                    node[0][ch] = ({}, [])
                node = node[0][ch]
            if text:
                node[1].append(token_id)

    def allowed_ids(self, dfa: DFA, state: int) -> list[int]:
        """Ids of the tokens whose text keeps the DFA alive from `state` (EOS not included).
        Depth first, and a node is entered only if the text up to it is alive: one dead
        character rules out every token that starts with that prefix."""
        if self.dfa is not None and dfa is not self.dfa:
            raise ValueError("this trie was built on another DFA's character classes")
        if not dfa.live(state):
            return []
        out: list[int] = []
        stack = [(self.root, state)]
        while stack:
            (children, ids), s = stack.pop()
            out += ids
            memo = dfa._memo[s]                    # dfa._step's cache, read inline: it is hot
            for ch, child in children.items():
                nxt = memo[ch] if ch in memo else dfa._step(s, ch)
                if nxt is not None:
                    stack.append((child, nxt))
        return out

    def mask(self, dfa: DFA, state: int, eos_id: int | None = None) -> torch.Tensor:
        """The same (len(vocab),) bool tensor as allowed_tokens(dfa, state, vocab, eos_id)."""
        return _mask(self.allowed_ids(dfa, state), self.size, dfa, state, eos_id)


class TokenIndex:
    """Per-state masks for one DFA and one vocabulary, each computed once: lazily by mask(),
    or all at once by precompute(). The masks are shared: treat them as read-only."""

    def __init__(self, dfa: DFA, vocab: Sequence[str | None], eos_id: int | None = None) -> None:
        self.dfa, self.vocab, self.eos_id = dfa, list(vocab), eos_id
        self.trie = VocabTrie(self.vocab, dfa)
        self._masks: dict[int, torch.Tensor] = {}
        _mask([], len(self.vocab), dfa, dfa.start, eos_id)        # checks eos_id

    def mask(self, state: int) -> torch.Tensor:
        """(len(vocab),) bool: the tokens allowed in `state`."""
        if state not in self._masks:
            self._masks[state] = self.trie.mask(self.dfa, state, self.eos_id)
        return self._masks[state]

    def precompute(self) -> TokenIndex:
        """Compute the mask of every live state (those a generation can reach); returns self."""
        for state in range(self.dfa.num_states):
            if self.dfa.live(state):
                self.mask(state)
        return self

    def next_state(self, state: int, token_id: int) -> int | None:
        """The DFA state after token `token_id` (not EOS) from `state`, or None if dead."""
        text = self.vocab[token_id]
        return self.dfa.walk(state, text) if text else None


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """New logits, -inf wherever `allowed` is False. logits (B, V) or (V,) float; allowed bool
    of shape (V,) (one mask for every row) or that of logits. ValueError when a row allows
    nothing: then no token continues towards a match, and sampling must not pick at random."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point torch.Tensor of shape (B, V) or (V,)")
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        raise TypeError("allowed must be a torch.bool tensor")
    if allowed.shape not in (logits.shape, logits.shape[-1:]):
        raise ValueError(f"allowed must have shape {tuple(logits.shape[-1:])} or "
                         f"{tuple(logits.shape)}, got {tuple(allowed.shape)}")
    if not allowed.any(dim=-1).all():
        raise ValueError("allowed has no True entry (in some row): no token can continue the "
                         "text towards a match")
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


# ----------------------------------------------------------------------------------------------
# Generation under a constraint, and the vocabulary's texts
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConstrainedResult(GenerationResult):
    """GenerationResult plus: forced (tokens appended without sampling because they were the
    only one allowed, a final EOS included), forward_passes (model calls; a run of forced
    tokens is read in one), complete (the text, EOS excluded, is a full match)."""

    forced: int = 0
    forward_passes: int = 0
    complete: bool = False


def constrained_generate(model: torch.nn.Module, tokenizer, prompt_ids,
                         constraint: DFA | TokenIndex, params: SamplingParams, *, eos_id: int,
                         generator: torch.Generator | None = None) -> ConstrainedResult:
    """Generate (batch size 1) a text that matches `constraint`, then EOS.

    constraint: a DFA (its TokenIndex is built from token_strings(tokenizer, V)) or a
    TokenIndex with the same eos_id (keep one across requests: it keeps its masks). tokenizer:
    decode(ids) -> str, or None (then no text, and the constraint must be a TokenIndex).
    params: the sampling knobs and max_new_tokens of tinygpt.sampling; stop strings are
    refused (the pattern and EOS decide where text ends).
    Each step: the state's mask; the only allowed token is forced; otherwise the model reads
    the tokens it has not seen (a KV cache when the model takes one: a forced run is one small
    prefill, DecodeStep.extend), then mask_logits and sample_next_token (greedy = argmax over
    the allowed tokens). Stops on EOS ("eos") or at max_new_tokens ("length"; see complete).
    With a large vocabulary a fixed string has several tokenizations, so few tokens are forced;
    engines that fast-forward a fixed string re-tokenize it instead.
    """
    if params.stop:
        raise ValueError(f"params.stop={params.stop!r}: stop strings are not used under a "
                         "constraint; the pattern and EOS decide where the text ends")
    vocab_size, max_seq_len = model_limits(model)
    index = constraint
    if isinstance(constraint, DFA):
        if tokenizer is None:
            raise ValueError("tokenizer=None needs a TokenIndex constraint: a DFA constraint's "
                             "TokenIndex is built from the tokenizer's token texts")
        index = TokenIndex(constraint, token_strings(tokenizer, vocab_size), eos_id)
    if not isinstance(index, TokenIndex):
        raise TypeError(f"constraint must be a DFA or a TokenIndex, got {type(index).__name__}")
    if index.eos_id != eos_id or len(index.vocab) != vocab_size:
        raise ValueError(f"the TokenIndex was built for eos_id={index.eos_id} and "
                         f"{len(index.vocab)} tokens; the call has eos_id={eos_id} and a model "
                         f"with {vocab_size}")
    prompt = prepare_prompt(prompt_ids, vocab_size, max_seq_len)
    total = prompt.shape[1] + params.max_new_tokens
    if total > max_seq_len:
        raise ValueError(f"prompt ({prompt.shape[1]}) + max_new_tokens "
                         f"({params.max_new_tokens}) exceeds the context window {max_seq_len}")
    device = model_device(model)
    if generator is None and params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    cache = KVCache.for_model(model, 1, total) if supports_kv_cache(model) else None
    if cache is None:
        step = None
    elif getattr(model, "quant_scheme", None) is not None:   # day 15's step (as generate's)
        from tinygpt.quant import QuantizedDecodeStep

        step = QuantizedDecodeStep(model, cache)
    else:
        step = DecodeStep(model, cache)
    ids, fed = prompt[0].tolist(), 0          # the context, and how much of it the model read
    state, new, forced, passes, reason = index.dfa.start, [], 0, 0, "length"
    while len(new) < params.max_new_tokens:
        allowed = index.mask(state)
        choices = allowed.nonzero().flatten().tolist()
        if len(choices) == 1:
            token, forced = choices[0], forced + 1
        else:                                  # none allowed: mask_logits says so
            unseen = torch.tensor([ids[fed:]], device=device)
            with step.token_threads() if step is not None and fed else contextlib.nullcontext():
                if step is None:
                    logits = last_token_logits(model, torch.tensor([ids], device=device))
                else:
                    logits = step.extend(unseen)[-1:] if fed else prefill(model, cache, unseen)
                generated = torch.tensor([new], dtype=torch.long).reshape(1, len(new))
                token = int(sample_next_token(mask_logits(logits, allowed), params, generator,
                                              prompt_ids=prompt, generated_ids=generated))
            fed, passes = len(ids), passes + 1
        new.append(token)
        if token == eos_id:
            reason = "eos"
            break
        ids.append(token)
        state = index.next_state(state, token)
    text = None if tokenizer is None else tokenizer.decode(new[:-1] if reason == "eos" else new)
    return ConstrainedResult(prompt_ids=prompt[0].tolist(), token_ids=new, stop_reason=reason,
                             text=text, forced=forced, forward_passes=passes,
                             complete=index.dfa.accepts(state))


def token_strings(tokenizer, vocab_size: int) -> list[str | None]:
    """Each id's text as the tokenizer decodes it ALONE, or None for an id never allowed.

    None for: special tokens (tokenizer.special_tokens; their name is not text for the model to
    write, and EOS is handled by eos_id), ids past the tokenizer's vocabulary (a padded model),
    empty texts, and byte-level BPE tokens whose bytes are not valid UTF-8 alone (a piece of a
    multi-byte character: 313 of SmolLM2's tokens, and tinygpt's byte tokens >= 0x80). The DFA
    reads characters, and half a character matches nothing, so these are never allowed. The
    cost: a non-ASCII character without a token of its own cannot be written; JSON can still
    write it as a \\uXXXX escape, so no meaning is lost (a DFA over UTF-8 bytes would lift the
    limit, with more states). The text comes from tokenizer.token_bytes when it has one (strict
    UTF-8), else from decode([id]), where a U+FFFD marks bytes that were not valid.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    specials = set(getattr(tokenizer, "special_tokens", {}).values())
    known = min(vocab_size, getattr(tokenizer, "vocab_size", vocab_size))
    out: list[str | None] = [None] * vocab_size
    for token_id in set(range(known)) - specials:
        if hasattr(tokenizer, "token_bytes"):
            with contextlib.suppress(UnicodeDecodeError):
                out[token_id] = tokenizer.token_bytes([token_id])[0].decode("utf-8") or None
        elif "\ufffd" not in (text := tokenizer.decode([token_id])):
            out[token_id] = text or None
    return out


# ----------------------------------------------------------------------------------------------
# JSON Schema -> regex
# ----------------------------------------------------------------------------------------------

_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'   # one character of a JSON string
SCALARS = {"string": f'"{_CHAR}*"', "integer": r"-?(0|[1-9][0-9]*)",
           "number": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
           "boolean": "(true|false)", "null": "null"}
NOTES = frozenset({"title", "description"})      # accepted everywhere, and ignored


def regex_escape(text: str) -> str:
    """A pattern of the subset that matches exactly `text`."""
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in text)


def _keywords(schema, where: str, allowed: set[str]) -> dict:
    if not isinstance(schema, dict):
        raise ValueError(f"schema at {where} must be a dict, got {type(schema).__name__}")
    for key in schema:
        if key not in allowed | NOTES:
            raise ValueError(f"schema at {where}: keyword {key!r} is not supported here; "
                             f"supported: {sorted(allowed | NOTES)}")
    return schema


def _bounds(schema: dict, where: str, low: str, high: str) -> tuple[int, int | None]:
    lo, hi = schema.get(low, 0), schema.get(high)
    for key, value in ((low, lo), (high, hi)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value <= MAX_REPEAT):
            raise ValueError(f"schema at {where}: {key} must be an int in [0, MAX_REPEAT = "
                             f"{MAX_REPEAT}] (a regex repeat count), got {value!r}")
    if hi is not None and hi < lo:
        raise ValueError(f"schema at {where}: {low} {lo} > {high} {hi}")
    return lo, hi


def _literal(value, where: str) -> str:
    if isinstance(value, (dict, list)):
        raise ValueError(f"schema at {where}: enum / const values must be strings, numbers, "
                         f"booleans or null (nested values need a grammar), got {value!r}")
    try:
        return regex_escape(json.dumps(value, separators=(",", ":"), allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ValueError(f"schema at {where}: {value!r} is no JSON value ({err})") from None


def _value(schema, where: str, nested: bool = False) -> str:
    """The regex of one field's value: a scalar type, an enum, a const, or an array of those
    (nested: `schema` is an array's items, which may not be an array)."""
    if isinstance(schema, dict) and ("enum" in schema or "const" in schema):
        _keywords(schema, where, {"enum"} if "enum" in schema else {"const"})
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise ValueError(f"schema at {where}: enum must be a non-empty list, got {values!r}")
        return "(" + "|".join(_literal(v, where) for v in values) + ")"
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" and ("minLength" in schema or "maxLength" in schema):
        _keywords(schema, where, {"type", "minLength", "maxLength"})
        lo, hi = _bounds(schema, where, "minLength", "maxLength")
        return f'"{_CHAR}{{{lo},{"" if hi is None else hi}}}"'
    if isinstance(kind, str) and kind in SCALARS:
        return SCALARS[_keywords(schema, where, {"type"})["type"]]
    if kind == "array" and not nested:
        _keywords(schema, where, {"type", "items", "minItems", "maxItems"})
        item = _value(schema.get("items"), where + ".items", nested=True)
        lo, hi = _bounds(schema, where, "minItems", "maxItems")
        if hi == 0:
            return r"\[\]"
        # the first item, then from lo - 1 to hi - 1 more; with no maxItems still at least
        # lo - 1 more (a plain * there would let {"minItems": 3} accept a single item)
        more = max(lo - 1, 0)
        if hi is not None:
            repeat = f"{{{more},{hi - 1}}}"
        else:
            repeat = f"{{{more},}}" if more else "*"
        items = f"{item}(,{item})" + repeat
        return r"\[" + (items if lo > 0 else f"({items})?") + r"\]"
    raise ValueError(f"schema at {where}: supported are a type among {sorted(SCALARS)}, an enum, "
                     f"a const, or an array of those; got {schema!r} (nested objects and "
                     f"arrays need a grammar, see schema_to_regex)")


def schema_to_regex(schema: dict) -> str:
    """A regex of the subset for the JSON texts of a schema: no whitespace, fields in order.

    The schema: {"type": "object", "properties": {...}, "required": [...]}; every property is
    required and the fields come in the order of "properties"; "additionalProperties" may only
    be False (what the regex does anyway). A property is {"type": T} with T among string (with
    minLength, maxLength), integer, number, boolean, null; {"enum": [...]} or {"const": v} of
    such values; or {"type": "array", "items": one of those, "minItems", "maxItems"}; each
    bound is at most MAX_REPEAT. Any other keyword is a ValueError naming it ("title" and
    "description" are ignored). The regex matches json.dumps(value, separators=(",", ":")),
    whose ensure_ascii writes non-ASCII characters as \\uXXXX escapes.

    Why a regex stops here: a finite automaton remembers nothing but its state, and it has
    finitely many. JSON nested to a FIXED depth is still regular (paste the inner regex in), but
    JSON in general nests without bound, and closing exactly as many brackets as were opened
    needs a counter that can grow: the balanced-brackets language, which no finite automaton
    accepts. Engines for full JSON Schema (recursive $ref, any nesting) run a pushdown
    automaton instead: a context-free grammar plus a stack of the brackets still open.
    """
    where = "$"
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise ValueError(f"schema at {where}: the top level must have type 'object', got "
                         f"{schema.get('type') if isinstance(schema, dict) else schema!r}")
    _keywords(schema, where, {"type", "properties", "required", "additionalProperties"})
    if schema.get("additionalProperties", False) is not False:
        raise ValueError(f"schema at {where}: additionalProperties must be False (absent means "
                         f"the same here): the regex lists exactly the given properties")
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise ValueError(f"schema at {where}: properties must be a dict and required a list")
    if sorted(required) != sorted(properties):
        raise ValueError(f"schema at {where}: every property must be required, and only "
                         f"properties (optional fields are not in this subset); properties "
                         f"{list(properties)}, required {required}")
    fields = [regex_escape(json.dumps(name)) + ":" + _value(sub, f"{where}.{name}")
              for name, sub in properties.items()]
    return r"\{" + ",".join(fields) + r"\}"
