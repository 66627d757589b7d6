"""Day 21's folders through the server: a Mistral folder with a sliding window, Llama folders
with YaRN and Llama 3.1 ("llama3") RoPE scaling, and a DeepSeek-V3 folder (latent attention
and routed experts), each of random weights, served by `create_app` over the engine, answer a
greedy completion with the tokens transformers' own generate() picks from the same folder.

The scaled Llamas' weights are drawn 0.2 wide (tests.test_rope_scaling.sharpen): with the
default 0.02 the same weights under plain RoPE pick the same 12 tokens, so a server that
ignored rope_scaling would pass. Now plain RoPE picks other tokens (10 of 12 differ; checked
below), and each greedy pick beats the runner-up by at least 0.056 in float64 (logits up to
6.3, transformers' float32 logits within 1.6e-5 of them; AMD EPYC with AVX-512, 2026-11-29)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.test_mla import hf_model as hf_deepseek  # noqa: E402
from tests.test_moe_hf import hf_greedy, serve_once  # noqa: E402
from tests.test_moe_hf import word_tokenizer as deepseek_words  # noqa: E402
from tests.test_rope_scaling import hf_llama, sharpen  # noqa: E402
from tests.test_rope_scaling import word_tokenizer as llama_words  # noqa: E402
from tests.test_sliding_window import hf_mistral  # noqa: E402

FOLDERS = {
    # (the model, its tokenizer, a prompt that runs past what makes the folder special)
    "mistral": (lambda: hf_mistral("sdpa", seed=2), lambda: llama_words(),
                " ".join(f"w{(7 * i) % 48}" for i in range(10))),        # window 6
    "yarn": (lambda: sharpen(hf_llama("yarn"), 0, 0.2), lambda: llama_words(),
             " ".join(f"w{(5 * i) % 48}" for i in range(70))),           # past 64 positions
    "llama3": (lambda: sharpen(hf_llama("llama3"), 0, 0.2), lambda: llama_words(),
               " ".join(f"w{(11 * i) % 48}" for i in range(70))),
    "deepseek_v3": (lambda: hf_deepseek(seed=5), lambda: deepseek_words(),
                    "the cat sat on the"),
}


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_the_server_answers_with_transformers_greedy_tokens(tmp_path, name):
    build, words, prompt = FOLDERS[name]
    hf = build()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    words().save_pretrained(tmp_path)
    body, tokenizer = serve_once(tmp_path, prompt, 12)
    ids = tokenizer.encode(prompt)
    theirs = hf_greedy(hf, ids, 12)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == 12
    assert body["choices"][0]["text"] == tokenizer.decode(theirs)
    if name in ("yarn", "llama3"):                    # the scaling decides the tokens
        assert hf_greedy(plain_rope(hf), ids, 12) != theirs


def plain_rope(hf):
    """A transformers Llama with `hf`'s weights and config but plain RoPE (same theta)."""
    theta = hf.config.rope_parameters["rope_theta"]
    config = type(hf.config).from_dict({**hf.config.to_dict(), "rope_parameters": {
        "rope_type": "default", "rope_theta": theta}})
    plain = type(hf)(config).eval()
    plain.load_state_dict(hf.state_dict())        # the rotary's inv_freq is not in it
    return plain
