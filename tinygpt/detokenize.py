"""A streamed reply's text, kept up to date one token at a time (incremental detokenizing).

A loop that streams text (tinygpt.generate's, and through it every engine and server request)
needs, after every new token, the text of all the tokens so far: a stop string or a multi-byte
character can span tokens, so the pieces of single tokens are not enough. Decoding all the ids
again each time costs more with every token; ReplyText keeps the text current at a constant
cost per token.
"""

from __future__ import annotations

import codecs


class ReplyText:
    """The text of the ids generated so far: `text` is tokenizer.decode(ids) after each append.

    A tokenizer whose decode(ids) is its decode_bytes(ids) read as UTF-8 with errors="replace"
    says so with DECODES_UTF8_BYTES = True (both of tinygpt's do). Its ids are followed one at a
    time: their bytes go through an incremental UTF-8 decoder, which holds back only an
    unfinished character (shown as decode shows it, U+FFFD), so a token costs as much at the
    thousandth token as at the first; decoding the whole reply again each token grew with its
    length (14 us at 64 ids, 215 us at 1,024: SmolLM2's tokenizer, AMD EPYC with AVX-512,
    2026-11-28). Any other tokenizer decodes all the ids again."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self._done = tokenizer, [], ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") \
            if getattr(tokenizer, "DECODES_UTF8_BYTES", False) else None
        self.text = ""

    def append(self, token_id: int) -> str:
        """Add one id; returns the text of all the ids so far."""
        self.ids.append(token_id)
        if self._utf8 is None:
            self.text = self.tokenizer.decode(self.ids)
            return self.text
        self._done += self._utf8.decode(self.tokenizer.decode_bytes([token_id]))
        pending = self._utf8.getstate()[0]          # the bytes of an unfinished character
        self.text = self._done + pending.decode("utf-8", "replace") if pending else self._done
        return self.text
