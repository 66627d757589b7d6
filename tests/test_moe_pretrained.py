"""Day 20's shipped mixture of experts (tinygpt/data/moe): it loads by name, decodes as the
uncached model does through generate() and the engine, and its experts specialise by word
class on the grammar corpus (the claim day 20's notebook shows)."""

from __future__ import annotations

import torch

from tinygpt import corpus
from tinygpt.engine import Engine
from tinygpt.generate import generate
from tinygpt.loading import load_model
from tinygpt.sampling import SamplingParams
from tinygpt.train import checkpoint_metadata, encode_stories, experts_by_word_class


def test_it_loads_by_name_as_recorded():
    model, tokenizer, info = load_model("tinygpt-moe")
    assert info.model_id == "tinygpt-moe" and model.cfg.is_moe
    cfg = model.cfg
    assert (cfg.n_experts, cfg.top_k, cfg.d_expert, cfg.router) == (8, 2, 88, "softmax")
    extra = checkpoint_metadata(info.source)["extra"]
    assert extra["n_parameters"] == sum(p.numel() for p in model.parameters()) == 1_387_648
    assert extra["eval_loss"] < extra["loss_floor"] + 0.02         # near the corpus entropy
    assert tokenizer.vocab_size == cfg.vocab_size


@torch.no_grad()
def test_generate_and_the_engine_decode_as_the_uncached_model():
    model, tokenizer, _ = load_model("tinygpt-moe")
    prompts = [tokenizer.encode(p) for p in ("The cat", "A small bird saw a", "The boy ran")]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    want = []
    for ids in prompts:                                      # the plain uncached argmax loop
        seq = list(ids)
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        want.append(seq[len(ids):])
    assert [generate(model, p, params).token_ids for p in prompts] == want
    engine = Engine(model, tokenizer, prefix_caching=True, max_running=3)
    assert [r.token_ids for r in engine.generate(prompts, params)] == want


def test_its_experts_specialise_by_word_class():
    model, tokenizer, _ = load_model("tinygpt-moe")
    stories = corpus.generate_corpus(200, seed=5).split("\n")
    table = experts_by_word_class(model, tokenizer, stories)
    assert sorted(table) == [0, 1, 2, 3]
    # the counts are each layer's chosen expert ids, window by window, per word class
    ids = encode_stories(stories, tokenizer)
    chosen = {i: [] for i in table}
    with torch.no_grad():
        for start in range(0, len(ids), model.cfg.max_seq_len):
            model(ids[start:start + model.cfg.max_seq_len][None])
            for i in table:
                chosen[i].append(model.layers[i].feed_forward.last_experts)
    classes = [corpus.WORD_CLASS.get(tokenizer.decode([int(t)]).strip(), "end") for t in ids]
    n = model.cfg.n_experts
    for i, layer in table.items():
        experts = torch.cat(chosen[i])                                   # (N, k) expert ids
        assert torch.equal(sum(layer.values()), torch.bincount(experts.reshape(-1), minlength=n))
        for name, counts in layer.items():
            rows = torch.tensor([c == name for c in classes])
            assert torch.equal(counts, torch.bincount(experts[rows].reshape(-1), minlength=n))
    # In some layer nearly every preposition's two slots go to the same two experts: a word
    # class with one job in the grammar gets experts of its own. Uniform routing would give
    # the busiest two experts 2/8 = 25% of the slots.
    best = max(float(counts.topk(2).values.sum() / counts.sum())
               for layer in table.values() for name, counts in layer.items()
               if name == "preposition")
    assert best > 0.95
