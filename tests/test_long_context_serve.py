"""Day 21's folders through the server: a Mistral folder with a sliding window, Llama folders
with YaRN and Llama 3.1 ("llama3") RoPE scaling, and a DeepSeek-V3 folder (latent attention
and routed experts), each of random weights, served by `create_app` over the engine, answer a
greedy completion with the tokens transformers' own generate() picks from the same folder."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.test_mla import hf_model as hf_deepseek  # noqa: E402
from tests.test_moe_hf import hf_greedy, serve_once  # noqa: E402
from tests.test_moe_hf import word_tokenizer as deepseek_words  # noqa: E402
from tests.test_rope_scaling import hf_llama  # noqa: E402
from tests.test_rope_scaling import word_tokenizer as llama_words  # noqa: E402
from tests.test_sliding_window import hf_mistral  # noqa: E402

FOLDERS = {
    # (the model, its tokenizer, a prompt that runs past what makes the folder special)
    "mistral": (lambda: hf_mistral("sdpa", seed=2), lambda: llama_words(),
                " ".join(f"w{(7 * i) % 48}" for i in range(10))),        # window 6
    "yarn": (lambda: hf_llama("yarn"), lambda: llama_words(),
             " ".join(f"w{(5 * i) % 48}" for i in range(70))),           # past 64 positions
    "llama3": (lambda: hf_llama("llama3"), lambda: llama_words(),
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
