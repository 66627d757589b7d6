"""The tokenizer stored inside a GGUF file: day 02's byte-level BPE with someone else's merges.

A GGUF file of a GPT-2-style model ("tokenizer.ggml.model" = "gpt2") carries its whole
tokenizer as metadata:

    tokenizer.ggml.tokens       every token as a string, its id = its position
    tokenizer.ggml.token_type   1 normal, 3 control (<|im_start|>, ...), 4 user-defined, ...
    tokenizer.ggml.merges       "Ġ t", "Ġ a", "i n", ...: the learned merges, first = rank 0
    tokenizer.ggml.pre          the pre-tokenizer rule's name ("smollm" for SmolLM2)
    tokenizer.ggml.bos/eos/padding/unknown_token_id, tokenizer.chat_template (Jinja2)

Three differences from the tokenizer we trained on day 02, none of them deep:

1. Token strings are not bytes. GPT-2 made byte-level BPE printable by giving each of the 256
   byte values a visible character: the printable ASCII and Latin-1 bytes stand for
   themselves, the other 68 (space, newline, controls ...) take the characters U+0100,
   U+0101, ... in byte order, so a space is "Ġ" and a newline "Ċ". `byte_to_char` rebuilds
   that table; a token's bytes are its characters mapped back.
2. Ids are not ranks. Our day-02 tokenizer gave the i-th merge id 256 + i, so "merge the
   lowest id" was "merge the earliest learned". Here the 17 control tokens come first and only
   235 of the 256 bytes have a token, so the rank of a merge is its position in the merge list.
   Encoding a chunk is the day-02 loop with that rank: among adjacent pairs (a, b) that are a
   listed merge, merge the earliest-listed one everywhere (`tinygpt.tokenizer.merge_pair`),
   repeat (`encode_piece_simple`). Only listed pairs merge: two parts whose concatenation is
   a token but which are not a listed pair stay apart (the byte-string ranks of tiktoken
   would join them). That loop rescans the piece after every merge, quadratic in its length;
   `encode_piece` makes the same merges in the same order from a heap of (rank, position),
   so a 100,000-character piece a client sends costs milliseconds, not minutes.
   A byte with no token (SmolLM2 has none for 21 byte values, e.g. 0x04 and 0xF5-0xFF) is
   dropped, which is what the Hugging Face tokenizer of the same file does; such text does
   not round-trip.
3. The split rule. "smollm" (like StarCoder's) first isolates every number character
   (\\p{N}), then splits each remaining piece with GPT-2's pattern. This is the rule of the
   tokenizer.json SmolLM2 is published with, and our ids equal that file's ids (through the
   `tokenizers` library) on every text compared but one kind, below. transformers 5.23's
   GGUF converter drops the digit step, so the GGUF file read by transformers splits
   differently around a number character after whitespace, and its ids differ in two cases:
   - whitespace of two or more characters before a number: ours keeps the run together,
     "a  1" -> "a", "  ", "1"; the converter's splits "a", " ", " 1";
   - one space before a number character that is not an ASCII digit (" ½", " ²", " ①", " Ⅻ",
     " ٣"): ours splits " " and "½"; the converter's keeps " ½" one piece, and SmolLM2's
     merges join the space with the first UTF-8 byte of the character (" ½" -> [216, 16738]
     here, [3351, 138] there). ASCII digits agree: no merge joins a space to one.
   The kind of text where we differ from both: the `regex` module and the Rust regex inside
   `tokenizers` carry different Unicode versions, so for a code point that one of them lists
   as unassigned they may disagree on "is this a letter / number / space", and the pieces
   around it differ ("!!\\U000323b0's": U+323B0 is a CJK ideograph of a newer Unicode than
   one of them knows; tinygpt.tokenizer's docstring has the same caveat against tiktoken).

Special tokens (token types 3 and 4) are produced only on request: `encode(text)` treats
"<|im_end|>" typed by a user as 10 characters of text; `encode(text, allowed_special=...)`
and the chat template produce them. `encode_chat` renders the file's own Jinja2 chat
template in a sandbox set up as transformers sets up its own (`chat_environment`), so that
the template's own text may produce special tokens and the content never does
(`chat_layout`): when no message content holds special-token text the rendered string is
encoded whole, special tokens parsed, exactly as the Hugging Face tokenizer encodes it;
otherwise each content is swapped for a marker and encoded as text (`runs_to_ids`), and a
template that changes the content it writes (`| trim`) is then a ValueError.
"""

from __future__ import annotations

import heapq
import json
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

import regex

from tinygpt.tokenizer import (
    _allowed_specials,
    _check_flag,
    _check_messages,
    _checked_ids,
    merge_pair,
)

# GPT-2's split pattern: contractions, optional space + letters, optional space + numbers,
# optional space + other symbols, whitespace not followed by a non-space, other whitespace.
GPT2_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"""
                r"""|\s+(?!\S)|\s+""")
# tokenizer.ggml.pre -> the patterns applied one after another (each splits every piece the
# previous one left, keeping the text between matches as pieces too)
SPLIT_RULES: dict[str, tuple[str, ...]] = {
    "gpt-2": (GPT2_PATTERN,),
    "gpt2": (GPT2_PATTERN,),
    "smollm": (r"\p{N}", GPT2_PATTERN),
    "starcoder": (r"\p{N}", GPT2_PATTERN),
}
END_OF_TURN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def byte_to_char() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte value: 256 entries, byte -> one character."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in visible}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def split_text(text: str, patterns: Sequence[str]) -> list[str]:
    """Apply the split patterns in turn; each keeps its matches and the text between them.

    split_text("a  12", SPLIT_RULES["smollm"]) -> ["a", "  ", "1", "2"]. The pieces always
    concatenate back to `text`.
    """
    pieces = [text]
    for pattern in patterns:
        compiled = regex.compile(pattern)
        out: list[str] = []
        for piece in pieces:
            end = 0
            for match in compiled.finditer(piece):
                if match.start() > end:
                    out.append(piece[end:match.start()])
                out.append(match.group())
                end = match.end()
            if end < len(piece):
                out.append(piece[end:])
        pieces = out
    return pieces


def specials_pattern(names: Iterable[str]) -> regex.Pattern | None:
    """A pattern that finds the special-token texts `names` (longest first, so "<|end|>" is
    not read as a shorter name it starts with) and captures each; None when there are none."""
    names = sorted(set(names), key=len, reverse=True)
    if not names:
        return None
    return regex.compile("(" + "|".join(regex.escape(name) for name in names) + ")")


def chat_environment():
    """A sandboxed Jinja2 environment set up as transformers' apply_chat_template sets up its
    own (transformers.utils.chat_template_utils), so a template renders the same text here:
    trim_blocks and lstrip_blocks; {% break %} and {% continue %} (jinja2.ext.loopcontrols);
    {% generation %}...{% endgeneration %} (its body, as written); `tojson` without HTML
    escaping, non-ASCII kept (ensure_ascii=False) and json.dumps' indent, separators and
    sort_keys; raise_exception(message); strftime_now(format), the local time; a `namespace`
    that refuses attribute names starting with "_"."""
    from jinja2 import TemplateError, nodes
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class GenerationBlock(Extension):
        # transformers marks the assistant's text with this tag; rendering keeps the body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template may not set the attribute {name!r} of a "
                                f"namespace (names starting with '_' are refused)")

    class SafeNamespace(Namespace):
        def __init__(*args, **kwargs):           # Namespace's own signature: self in args
            for name in dict(*args[1:], **kwargs):
                check_name(name)
            Namespace.__init__(*args, **kwargs)

        def __setitem__(self, name, value):
            check_name(name)
            Namespace.__setitem__(self, name, value)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationBlock])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=SafeNamespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def chat_layout(render: Callable[[list[str]], str], contents: Sequence[str],
                specials: regex.Pattern | None) -> tuple[str, list[tuple[bool, str]] | None]:
    """How a rendered conversation becomes ids with every message's content kept as text.

    render(contents) renders the chat template with `contents` in place of the messages' own;
    specials finds the tokenizer's special-token texts (`specials_pattern`). Returns (text,
    runs), text the conversation as the template renders it. runs is None when text may be
    encoded whole with special tokens parsed (what transformers' apply_chat_template does): no
    content holds special-token text, and text has the same special tokens, in order, as the
    template renders around a random marker in place of each content. Otherwise runs is a
    marker rendering cut at the template's own special tokens: (True, name) for each and
    (False, text) for the text between two (template text and contents put back, joined), to
    be encoded with special-token text read as text. The markers stand in for every content
    when the template writes each content as it is given (the marker rendering with the
    contents put back is text). A template that changes what it writes (`| trim`, `| tojson`,
    a slice, a branch on the content) gives runs None when no content holds special-token
    text; otherwise the markers stand in only for the contents that hold it, the others being
    part of the template's text (as when no content holds any), and that needs the template
    to write each content that holds special-token text as it is given: a ValueError naming
    the first message whose content it changes otherwise (that content could not be told
    apart from the template's special tokens).
    """
    text = render(list(contents))
    if specials is None:
        return text, None
    holding = [i for i, content in enumerate(contents) if specials.search(content)]
    nonce = secrets.token_hex(8)
    markers = [f"\ue000{nonce}:{i}\ue001" for i in range(len(contents))]
    by_marker = dict(zip(markers, contents, strict=True))
    split = regex.compile(f"(\ue000{nonce}:[0-9]+\ue001)")

    def marked_parts(marked: Iterable[int]) -> list[str]:
        chosen = set(marked)
        return split.split(render([markers[i] if i in chosen else content
                                   for i, content in enumerate(contents)]))

    def put_back(parts: list[str]) -> str:
        return "".join(by_marker.get(part, part) for part in parts)

    parts = marked_parts(range(len(contents)))
    if not holding and specials.findall(text) == specials.findall("".join(parts)):
        return text, None
    if put_back(parts) != text:
        if not holding:
            return text, None
        # the template changes some content: mark only those that hold special-token text
        parts = marked_parts(holding)
        if put_back(parts) != text:
            changed = next((i for i in holding if put_back(marked_parts([i])) != text),
                           holding[0])
            raise ValueError(f"messages[{changed}]['content'] holds special-token text, and "
                             f"this chat template changes the content it writes (with a "
                             f"filter such as | trim), so the content cannot be kept apart "
                             f"from the template's special tokens; remove the special-token "
                             f"text (or what the template changes, such as spaces at its "
                             f"ends) from the message")
    runs: list[tuple[bool, str]] = []
    waiting: list[str] = []                   # text since the last special token
    for part in parts:
        if part in by_marker:
            waiting.append(by_marker[part])
            continue
        for piece in specials.split(part):
            if specials.fullmatch(piece):
                if waiting:
                    runs.append((False, "".join(waiting)))
                    waiting.clear()
                runs.append((True, piece))
            else:
                waiting.append(piece)
    if "".join(waiting):
        runs.append((False, "".join(waiting)))
    return text, runs


def runs_to_ids(runs: list[tuple[bool, str]], special_ids: Mapping[str, int],
                encode_text: Callable[[str], list[int]]) -> list[int]:
    """chat_layout's runs as ids: each special token's id, each text run encoded by
    encode_text (which reads special-token text as text)."""
    ids: list[int] = []
    for special, run in runs:
        if special:
            ids.append(special_ids[run])
        else:
            ids.extend(encode_text(run))
    return ids


class GGUFTokenizer:
    """A GPT-2-style byte-level BPE tokenizer read from GGUF metadata.

    Attributes: tokens (the token strings, by id), token_bytes_table (each id's bytes),
    merges {(left_id, right_id): (rank, new_id)}, special_tokens {text: id} (control and
    user-defined tokens), bos_id / eos_id / pad_id (None when the file has none), add_bos
    (whether a text's ids start with bos_id: tokenizer.ggml.add_bos_token; `encode` itself
    never adds it, callers such as the server do), chat_template (a Jinja2 string or None),
    pre (the split rule's name).
    Build one with `GGUFTokenizer.from_gguf(path)`.
    """

    # decode(ids) is decode_bytes(ids) as UTF-8 with errors="replace" (detokenize.ReplyText)
    DECODES_UTF8_BYTES = True

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int],
                 merges: Sequence[str], pre: str, *, bos_id: int | None = None,
                 eos_id: int | None = None, pad_id: int | None = None,
                 chat_template: str | None = None, add_bos: bool = False) -> None:
        if len(token_types) != len(tokens):
            raise ValueError(f"token_types has {len(token_types)} entries but tokens has "
                             f"{len(tokens)}")
        if pre not in SPLIT_RULES:
            raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported; supported rules: "
                             f"{sorted(SPLIT_RULES)}")
        char_to_byte = {c: b for b, c in byte_to_char().items()}
        self.tokens = list(tokens)
        self.special_tokens: dict[str, int] = {}
        table: list[bytes] = []
        ids: dict[str, int] = {}
        for i, (token, kind) in enumerate(zip(tokens, token_types, strict=True)):
            if kind in (CONTROL, USER_DEFINED):
                self.special_tokens[token] = i
                table.append(token.encode("utf-8"))
                continue
            try:
                table.append(bytes(char_to_byte[c] for c in token))
            except KeyError as err:
                raise ValueError(f"token {i} {token!r} has the character {err.args[0]!r}, "
                                 f"which is no byte of GPT-2's byte-level alphabet") from None
            ids.setdefault(token, i)
        self.token_bytes_table = table
        self.byte_ids = {b: ids[c] for b, c in byte_to_char().items() if c in ids}
        self.merges: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, merge in enumerate(merges):
            parts = merge.split(" ")
            if len(parts) != 2 or parts[0] not in ids or parts[1] not in ids \
                    or parts[0] + parts[1] not in ids:
                raise ValueError(f"merge {rank} {merge!r} is not 'left right' with left, right "
                                 f"and their concatenation all tokens")
            self.merges[(ids[parts[0]], ids[parts[1]])] = (rank, ids[parts[0] + parts[1]])
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if value is not None and not 0 <= value < len(tokens):
                raise ValueError(f"{name} {value} is not a token id (0..{len(tokens) - 1})")
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        if not isinstance(add_bos, bool) or (add_bos and bos_id is None):
            raise ValueError(f"add_bos must be a bool, and True only with a bos_id; got "
                             f"add_bos={add_bos!r}, bos_id={bos_id!r}")
        self.add_bos = add_bos
        self.pre = pre
        self.patterns = SPLIT_RULES[pre]
        self.chat_template = chat_template
        self._cache: dict[str, list[int]] = {}
        self._template = None
        self._specials = specials_pattern(self.special_tokens)

    @classmethod
    def from_gguf(cls, source) -> GGUFTokenizer:
        """The tokenizer of a GGUF file (a path or an open `tinygpt.gguf.open_gguf` reader).

        ValueError when the file has no tokenizer or one that is not GPT-2-style BPE."""
        from tinygpt.gguf import metadata, open_gguf

        reader = open_gguf(source) if isinstance(source, (str, Path)) else source
        model = metadata(reader, "tokenizer.ggml.model", None)
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') "
                             f"tokenizers are supported")
        tokens = metadata(reader, "tokenizer.ggml.tokens")
        return cls(tokens, metadata(reader, "tokenizer.ggml.token_type", [NORMAL] * len(tokens)),
                   metadata(reader, "tokenizer.ggml.merges"),
                   metadata(reader, "tokenizer.ggml.pre", "gpt2"),
                   bos_id=metadata(reader, "tokenizer.ggml.bos_token_id", None),
                   eos_id=metadata(reader, "tokenizer.ggml.eos_token_id", None),
                   pad_id=metadata(reader, "tokenizer.ggml.padding_token_id", None),
                   chat_template=metadata(reader, "tokenizer.chat_template", None),
                   add_bos=bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)))

    def __repr__(self) -> str:
        return (f"GGUFTokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"pre={self.pre!r}, special_tokens={len(self.special_tokens)})")

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn: the chat template's end marker(s), then eos."""
        ids = [self.special_tokens[n] for n in END_OF_TURN_NAMES if n in self.special_tokens]
        if self.eos_id is not None:
            ids.append(self.eos_id)
        return tuple(dict.fromkeys(ids))

    # -- encoding ------------------------------------------------------------------------------

    def _byte_ids(self, piece: str) -> list[int]:
        return [self.byte_ids[b] for b in piece.encode("utf-8") if b in self.byte_ids]

    def encode_piece_simple(self, piece: str) -> list[int]:
        """One pre-tokenized piece -> ids with day 02's loop: find the adjacent pair of lowest
        merge rank, `merge_pair` it everywhere, repeat. Quadratic in the piece's length: the
        reference that `encode_piece` is tested against."""
        ids = self._byte_ids(piece)
        merges = self.merges
        while len(ids) > 1:
            best = min(zip(ids, ids[1:], strict=False),
                       key=lambda pair: merges.get(pair, (len(merges),))[0])
            if best not in merges:
                break
            ids = merge_pair(ids, best, merges[best][1])
        return ids

    def encode_piece(self, piece: str) -> list[int]:
        """One pre-tokenized piece -> ids: the same merges as `encode_piece_simple`, found with a
        heap of (rank, position) over a linked list of parts, so a long piece (a run of 100,000
        spaces) costs n log n, not n^2. Equal ranks merge leftmost first, as merge_pair does."""
        ids = self._byte_ids(piece)
        n = len(ids)
        if n < 2:
            return ids
        merges = self.merges
        nxt = list(range(1, n + 1))                    # n means "no next part"
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = [(merges[pair][0], i) for i, pair in enumerate(zip(ids, ids[1:], strict=False))
                if pair in merges]
        heapq.heapify(heap)
        while heap:
            rank, i = heapq.heappop(heap)
            j = nxt[i]
            if not alive[i] or j >= n:
                continue
            found = merges.get((ids[i], ids[j]))
            if found is None or found[0] != rank:      # stale: a part changed since the push
                continue
            ids[i] = found[1]
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[i] < n:
                prv[nxt[i]] = i
            for left in (prv[i], i):
                if left >= 0 and nxt[left] < n:
                    pair = merges.get((ids[left], ids[nxt[left]]))
                    if pair is not None:
                        heapq.heappush(heap, (pair[0], left))
        return [token for token, keep in zip(ids, alive, strict=True) if keep]

    def _encode_ordinary(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        if len(cache) > 100_000:
            cache.clear()
        for piece in split_text(text, self.patterns):
            ids = cache.get(piece)
            if ids is None:
                ids = cache[piece] = self.encode_piece(piece)
            out.extend(ids)
        return out

    def encode(self, text: str, allowed_special: str | Iterable[str] = ()) -> list[int]:
        """Text -> ids (n_tokens,). Special-token text becomes special ids only for the names in
        allowed_special ("all", or a set such as {"<|im_start|>"}); otherwise it is text."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text contains the lone surrogate {text[exc.start]!r} at index "
                             f"{exc.start}, which has no UTF-8 encoding") from None
        allowed = _allowed_specials(allowed_special, self.special_tokens)
        if not allowed:
            return self._encode_ordinary(text)
        pattern = self._specials if allowed == set(self.special_tokens) else \
            specials_pattern(allowed)
        ids: list[int] = []
        for part in pattern.split(text):
            if part in allowed:
                ids.append(self.special_tokens[part])
            elif part:
                ids.extend(self._encode_ordinary(part))
        return ids

    # -- the chat template ---------------------------------------------------------------------

    def _compiled_template(self):
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer.chat_template); "
                             "use plain completions")
        if self._template is None:
            self._template = chat_environment().from_string(self.chat_template)
        return self._template

    def _render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
                contents: Sequence[str]) -> str:
        from jinja2 import TemplateError

        turns = [{"role": role, "content": content}
                 for (role, _), content in zip(_check_messages(messages), contents, strict=True)]
        special = {v: k for k, v in self.special_tokens.items()}
        try:
            return self._compiled_template().render(
                messages=turns, add_generation_prompt=add_generation_prompt,
                bos_token=special.get(self.bos_id, ""), eos_token=special.get(self.eos_id, ""))
        except TemplateError as err:
            raise ValueError(f"the chat template refused the messages: {err}") from None

    def render_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> str:
        """The conversation as the chat template lays it out (a string, for reading)."""
        _check_flag(add_generation_prompt, "add_generation_prompt")
        turns = _check_messages(messages)
        return self._render(messages, add_generation_prompt, [c for _, c in turns])

    def encode_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """A conversation -> ids through the file's chat template. Special tokens come only from
        the template's own text; message contents are always encoded as text (`chat_layout`:
        ValueError for content holding special-token text that the template changes)."""
        _check_flag(add_generation_prompt, "add_generation_prompt")
        turns = _check_messages(messages)
        text, runs = chat_layout(
            lambda contents: self._render(messages, add_generation_prompt, contents),
            [content for _, content in turns], self._specials)
        if runs is None:
            return self.encode(text, allowed_special="all")
        return runs_to_ids(runs, self.special_tokens, self._encode_ordinary)

    # -- decoding ------------------------------------------------------------------------------

    def token_bytes(self, ids: Iterable[int]) -> list[bytes]:
        """The bytes of each id (a special token gives its text). ids: an iterable of ints or a
        1-D integer tensor / array (not bool, not float): anything else is a TypeError naming
        ids, an id out of range a ValueError."""
        table = self.token_bytes_table
        return [table[token_id] for token_id in _checked_ids(ids, len(table))]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes(ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; bytes that are not valid UTF-8 (a cut character) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

