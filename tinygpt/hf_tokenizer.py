"""A Hugging Face folder's tokenizer behind the interface the server, the chat command and the
engine use (the one tinygpt.tokenizer.BPETokenizer and tinygpt.gguf_tokenizer.GGUFTokenizer
have): encode, decode, encode_chat and special_tokens. tinygpt.loading builds it for a folder
whose tokenizer files transformers reads (from disk only)."""

from __future__ import annotations


class HFTokenizer:
    """A Hugging Face tokenizer behind the interface the server uses: encode, decode (prefix
    stable: no clean-up of spaces), encode_chat (the tokenizer's own chat template) and
    special_tokens (its end-of-sequence id, as "<|endoftext|>")."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.special_tokens = {} if eos is None else {"<|endoftext|>": int(eos)}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)   # a BatchEncoding
