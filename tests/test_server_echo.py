"""Echo with logprobs when the tokenizer puts a BOS before a text prompt (a GGUF file with
add_bos, a Hugging Face folder whose post-processor adds one): the BOS is among the prompt's
tokens but not in the echoed text, so its text_offset is 0 and it takes up no characters."""

from __future__ import annotations

import copy
import json

import pytest

from tests.test_server_api import Served
from tinygpt import load_pretrained


@pytest.fixture(scope="module")
def served_with_bos():
    model, tokenizer = load_pretrained()
    with_bos = copy.copy(tokenizer)
    with_bos.bos_id, with_bos.add_bos = tokenizer.special_tokens["<|endoftext|>"], True
    served = Served(model.eval(), with_bos, max_waiting=4)
    yield served, tokenizer
    served.close()


def offsets_of(text: str, tokens: list[str]) -> list[int]:
    """Where each token's text starts in `text`, read left to right (each must be there)."""
    out, at = [], 0
    for token in tokens:
        at = text.index(token, at)
        out.append(at)
        at += len(token)
    return out


def test_an_echoed_prompt_s_bos_is_at_offset_0_and_takes_no_characters(served_with_bos):
    """The offsets counted the BOS's 13 characters that the text leaves out: 'The cat' came
    back as [0, 13, 16] followed by the reply's from 7, running backwards."""
    served, tokenizer = served_with_bos
    body = {"prompt": "The cat", "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 0}
    choice = served.post("/v1/completions", body).json()["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    n = len(tokenizer.encode("The cat"))
    assert text.startswith("The cat") and logprobs["tokens"][0] == "<|endoftext|>"
    assert len(logprobs["tokens"]) == 1 + n + 3
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets[1:] == offsets_of(text, logprobs["tokens"][1:])
    assert offsets == sorted(offsets)
    # streamed, the same offsets
    lines = served.post("/v1/completions", {**body, "stream": True}).text.splitlines()
    parts = [line[len("data: "):] for line in lines if line.startswith("data: {")]
    streamed = sum((json.loads(p)["choices"][0]["logprobs"]["text_offset"] for p in parts), [])
    assert streamed == offsets


def test_a_token_prompt_keeps_its_bos_text_in_the_echo(served_with_bos):
    """Token ids are taken as they are: a BOS written among them is echoed as its text, and
    the offsets count it."""
    served, tokenizer = served_with_bos
    bos = tokenizer.special_tokens["<|endoftext|>"]
    ids = [bos, *tokenizer.encode("The cat")]
    choice = served.post("/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0,
                                             "echo": True, "logprobs": 0}).json()["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    assert text.startswith("<|endoftext|>The cat")
    assert logprobs["text_offset"] == offsets_of(text, logprobs["tokens"])
