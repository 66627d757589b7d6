"""Day 21's folders through the server: a Mistral folder with a sliding window, Llama folders
with YaRN and Llama 3.1 ("llama3") RoPE scaling, and a DeepSeek-V3 folder (latent attention
and routed experts), each of random weights, served by `create_app` over the engine, answer a
greedy completion with the tokens transformers' own generate() picks from the same folder."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("transformers")

from tests.test_mla import hf_model as hf_deepseek  # noqa: E402
from tests.test_moe_hf import hf_greedy  # noqa: E402
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


def serve_once(folder, prompt: str, max_tokens: int) -> tuple[dict, object]:
    """POST one greedy /v1/completions to an in-process server of `folder`; (body, tokenizer)."""
    from tinygpt.engine import AsyncEngine
    from tinygpt.loading import load_model
    from tinygpt.server import create_app

    model, tokenizer, info = load_model(folder)
    loop = asyncio.new_event_loop()
    engine = AsyncEngine(model, tokenizer, max_waiting=8)
    app = create_app(engine, tokenizer, info.context_length, model_id=info.model_id,
                     eos_ids=info.eos_ids, end_of_turn_ids=info.end_of_turn_ids)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                               timeout=60)
    try:
        response = loop.run_until_complete(client.post("/v1/completions", json={
            "model": info.model_id, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}))
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(engine.shutdown(1.0))
        loop.close()
    assert response.status_code == 200, response.text
    return response.json(), tokenizer


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
