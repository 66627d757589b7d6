"""A Hugging Face folder's tokenizer behind the interface the server, the chat command and the
engine use (the one tinygpt.tokenizer.BPETokenizer and tinygpt.gguf_tokenizer.GGUFTokenizer
have): encode, decode, token_bytes, encode_chat, special_tokens, and bos_id / add_bos.
tinygpt.loading builds it for a folder whose tokenizer files transformers reads (from disk
only)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence

from tinygpt.gguf_tokenizer import byte_to_char, chat_layout, runs_to_ids, specials_pattern
from tinygpt.tokenizer import _check_flag, _check_messages, _checked_ids


def _added_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text when it encodes
    with add_special_tokens=True (Llama's BOS: ([bos], []); Qwen's: ([], []))."""
    bare = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    raise ValueError(f"the tokenizer encodes 'a' as {bare} and, with its special tokens, as "
                     f"{full}, which does not hold {bare}: its post-processor is not "
                     f"supported")


def _decoder_types(decoder: dict | None) -> dict[str, dict]:
    """A tokenizer.json decoder's steps by type (a Sequence's steps included)."""
    if not decoder:
        return {}
    steps = {decoder.get("type"): decoder}
    for step in decoder.get("decoders") or ():
        steps.update(_decoder_types(step))
    return steps


def _piece_reader(decoder: dict | None) -> Callable[[str], bytes | None] | None:
    """How a vocabulary piece (convert_ids_to_tokens) becomes its bytes for the tokenizer's
    decoder, or None for a decoder this does not know (WordPiece, ...). Byte-level BPE: each
    character is a byte of GPT-2's printable alphabet; sentencepiece style (Metaspace, or
    Replace and ByteFallback steps): "<0xNN>" is the byte NN when the decoder falls back to
    bytes, and the word mark (U+2581) is a space. The reader gives None for a piece it cannot
    map (a character outside the byte-level alphabet)."""
    steps = _decoder_types(decoder)
    if "ByteLevel" in steps:
        to_byte = {char: byte for byte, char in byte_to_char().items()}

        def byte_level(piece: str) -> bytes | None:
            try:
                return bytes(to_byte[char] for char in piece)
            except KeyError:
                return None
        return byte_level
    if not {"Metaspace", "Replace", "ByteFallback"} & steps.keys():
        return None
    mark = steps.get("Metaspace", {}).get("replacement", "\u2581")
    fallback = "ByteFallback" in steps

    def sentencepiece(piece: str) -> bytes:
        if fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace(mark, " ").encode("utf-8")
    return sentencepiece


class HFTokenizer:
    """A Hugging Face tokenizer behind the interface the server uses.

    encode(text): the text's own ids, with no BOS (special-token text such as "<|im_end|>" in
    it is read as that token, as transformers reads it; the server reads prompts so for every
    tokenizer). bos_id / add_bos: the token the tokenizer's post-processor puts before a text
    and whether it does (then the callers add it, as for GGUFTokenizer); without one, bos_id
    is the tokenizer's bos_token_id. A post-processor that adds anything else (an EOS after
    the text, two tokens before it) is a ValueError here. decode(ids): prefix stable (no
    clean-up of spaces). encode_chat: the tokenizer's own chat template, with each message's
    content kept as text (tinygpt.gguf_tokenizer.chat_layout): when no content holds
    special-token text, the ids are apply_chat_template's. "Special" means an added token
    marked special; other added tokens are ordinary vocabulary to transformers, in content
    too. When a content does hold special-token text, the text between two of the template's
    special tokens is encoded on its own, which differs from a whole encoding only for a
    tokenizer that marks the start of the whole text alone (a Metaspace pre-tokenizer with
    prepend_scheme "first": each such run then starts with its mark). special_tokens: its
    end-of-sequence id, as "<|endoftext|>" (the name the server reads the EOS by);
    special_token_ids: the added tokens marked special, by their own text (what
    /tokenizer_info reports). chat_template (None without one) and pad_id (the tokenizer's
    pad_token_id, or None) as GGUFTokenizer has them. decode and token_bytes read an id past
    the tokenizer's vocabulary (a model whose embeddings are padded past it) as no text, as
    transformers does; the server refuses ids past the model's own vocabulary.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.special_tokens = {} if eos is None else {"<|endoftext|>": int(eos)}
        before, after = _added_ids(tokenizer)
        if len(before) > 1 or after:
            raise ValueError(f"the tokenizer puts {before} before a text and {after} after it; "
                             f"only one token before it (a BOS) is supported")
        self.add_bos = bool(before)
        bos = before[0] if before else tokenizer.bos_token_id
        self.bos_id = None if bos is None else int(bos)
        # the special tokens the chat template may write and a message's content may not
        added = tokenizer.added_tokens_decoder
        self._chat_specials = {token.content: int(token_id) for token_id, token
                               in added.items() if token.special}
        self.special_token_ids = dict(self._chat_specials)
        self._specials = specials_pattern(self._chat_specials)
        self._added_bytes = {int(token_id): token.content.encode("utf-8")
                             for token_id, token in added.items()}
        template = getattr(tokenizer, "chat_template", None)
        self.chat_template = template if isinstance(template, str) and template else None
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = None if pad is None else int(pad)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._as_text = None
        self._read_piece = None
        if backend is not None:
            # a copy that reads special-token text as text; setting encode_special_tokens on
            # the shared backend instead would race with other threads' encodes
            from tokenizers import Tokenizer

            spec = backend.to_str()
            self._as_text = Tokenizer.from_str(spec)
            self._as_text.encode_special_tokens = True
            self._read_piece = _piece_reader(json.loads(spec).get("decoder"))

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_as_text(self, text: str) -> list[int]:
        if self._as_text is not None:
            return list(self._as_text.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False,
                                          split_special_tokens=True))

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text. ids as for token_bytes; an id past the tokenizer's vocabulary gives no
        text."""
        n = len(self.tokenizer)
        known = [token_id for token_id in _checked_ids(ids) if token_id < n]
        return self.tokenizer.decode(known, clean_up_tokenization_spaces=False)

    def token_bytes(self, ids: Iterable[int]) -> list[bytes]:
        """The bytes of each id: an added token's (special or not) are its text's UTF-8, a
        vocabulary piece's its own bytes (a byte token's is that one byte, though it is no
        UTF-8 alone), an id past the tokenizer's vocabulary's b"". ids: an iterable of ints or
        a 1-D integer tensor / array (not bool, not float), each >= 0: TypeError /
        ValueError naming ids otherwise. A tokenizer whose decoder is neither byte-level nor
        sentencepiece style gives each id's decode([id]) as UTF-8."""
        checked = _checked_ids(ids)
        n = len(self.tokenizer)
        out = []
        for token_id in checked:
            if token_id >= n:
                out.append(b"")
            elif token_id in self._added_bytes:
                out.append(self._added_bytes[token_id])
            else:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                own = None if piece is None or self._read_piece is None \
                    else self._read_piece(piece)
                out.append(own if own is not None else self.tokenizer.decode(
                    [token_id], clean_up_tokenization_spaces=False).encode("utf-8"))
        return out

    def encode_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """A conversation -> ids through the tokenizer's chat template. Special tokens come
        only from the template's own text; message contents are always encoded as text."""
        from jinja2 import TemplateError

        _check_flag(add_generation_prompt, "add_generation_prompt")
        turns = _check_messages(messages)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions")

        def render(contents: list[str]) -> str:
            conversation = [{"role": role, "content": content}
                            for (role, _), content in zip(turns, contents, strict=True)]
            try:
                return self.tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
            except TemplateError as err:
                raise ValueError(f"the chat template refused the messages: {err}") from None

        text, runs = chat_layout(render, [content for _, content in turns], self._specials)
        if runs is None:        # apply_chat_template(tokenize=True) encodes the text so
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return runs_to_ids(runs, self._chat_specials, self._encode_as_text)
