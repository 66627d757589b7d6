"""Tests of tinygpt.train: batches, schedule, training, checkpoints, word probabilities, KL."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tinygpt import corpus
from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.train import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    build_tokenizer,
    checkpoint_metadata,
    encode_stories,
    evaluate,
    get_batch,
    kl_divergence,
    kl_to_truth,
    load_checkpoint,
    load_pretrained,
    lr_at,
    model_next_word_distribution,
    model_word_log_probs,
    sample_text,
    save_checkpoint,
    train,
)

# --------------------------------------------------------------------------------------------
# Fixtures: a tiny tokenizer (small vocab, so some words take several tokens) and tiny model.
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread, and on a busy shared machine extra OpenMP threads
    mostly wait for each other; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stories() -> list[str]:
    return corpus.generate_corpus(400, seed=3).split("\n")


@pytest.fixture(scope="module")
def small_tokenizer(stories):
    return build_tokenizer(stories, max_vocab_size=300)   # 39 merges: many words split


def tiny_model(vocab_size: int, tie: bool = False, seed: int = 0) -> TinyGPT:
    cfg = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_ff=64, max_seq_len=64, tie_embeddings=tie)
    return TinyGPT(cfg, seed=seed).eval()


@pytest.fixture(scope="module")
def pretrained():
    return load_pretrained()


# --------------------------------------------------------------------------------------------
# Data and schedule.
# --------------------------------------------------------------------------------------------


def test_encode_stories_layout(small_tokenizer):
    tok = small_tokenizer
    data = encode_stories(["The cat sat.", "A dog ran."], tok)
    eot = tok.eot_id
    expected = [eot] + tok.encode("The cat sat.") + [eot] + tok.encode("A dog ran.") + [eot]
    assert data.dtype == torch.long and data.tolist() == expected
    assert tok.decode(data.tolist()) == "<|endoftext|>The cat sat.<|endoftext|>A dog ran." \
        "<|endoftext|>"


def test_build_tokenizer_saturates_below_the_request(stories):
    tok = build_tokenizer(stories, max_vocab_size=512)
    assert tok.vocab_size < 512
    words = set(corpus.split_words(" ".join(stories)))
    for word in words - {"."}:  # every word is one token (with its leading space)
        assert len(tok.encode(" " + word)) == 1, word
    with pytest.raises(TypeError, match="stories must be a list"):
        build_tokenizer("The cat sat.", 512)


def test_get_batch_windows_are_shifted_slices():
    data = torch.arange(100, 200)
    gen = torch.Generator().manual_seed(0)
    x, y = get_batch(data, batch_size=5, block_size=7, generator=gen)
    assert x.shape == y.shape == (5, 7)
    for row_x, row_y in zip(x, y, strict=True):
        start = int(row_x[0]) - 100
        assert row_x.tolist() == list(range(100 + start, 107 + start))
        assert row_y.tolist() == (row_x + 1).tolist()
    x2, _ = get_batch(data, 5, 7, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="at least block_size"):
        get_batch(torch.arange(5), 2, 7, gen)


def test_lr_schedule():
    assert [lr_at(s, 2, 1.0, 1, 0.1) for s in range(2)] == [1.0, 1.0]   # one step after warm-up
    values = [lr_at(s, 110, 1e-3, 10, 1e-4) for s in range(110)]
    assert values[0] == pytest.approx(1e-4) and values[9] == pytest.approx(1e-3)
    assert values[10] == pytest.approx(1e-3) and values[-1] == pytest.approx(1e-4)
    assert values[60] == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 50 / 99)))
    assert all(a >= b for a, b in zip(values[10:], values[11:], strict=False))
    with pytest.raises(ValueError, match="step must be in"):
        lr_at(110, 110, 1e-3, 10, 1e-4)


# --------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------


def test_tiny_training_run_decreases_the_loss(stories, small_tokenizer):
    data = encode_stories(stories, small_tokenizer)
    torch.manual_seed(0)
    model = tiny_model(small_tokenizer.vocab_size)
    before = evaluate(model, data, block_size=32)
    assert before == pytest.approx(math.log(small_tokenizer.vocab_size), rel=0.05)  # ~uniform
    losses = train(model, data, steps=30, batch_size=8, block_size=32, lr=1e-2, min_lr=1e-3,
                   warmup_steps=3, seed=0, progress=False)
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert evaluate(model, data, block_size=32) < before - 1.0
    # the same seed gives the same run
    again = tiny_model(small_tokenizer.vocab_size)
    losses2 = train(again, data, steps=30, batch_size=8, block_size=32, lr=1e-2, min_lr=1e-3,
                    warmup_steps=3, seed=0, progress=False)
    assert losses2 == losses


def test_evaluate_matches_a_hand_loop(stories, small_tokenizer):
    data = encode_stories(stories[:40], small_tokenizer)
    model = tiny_model(small_tokenizer.vocab_size, seed=5)
    n = (len(data) - 1) // 16
    nll = 0.0
    for i in range(n):
        x = data[i * 16: (i + 1) * 16]
        y = data[i * 16 + 1: (i + 1) * 16 + 1]
        logp = torch.log_softmax(model(x[None])[0], dim=-1)
        nll -= logp[torch.arange(16), y].sum().item()
    assert evaluate(model, data, block_size=16, batch_size=3) == pytest.approx(nll / (16 * n))
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"batch_size must be >= 1, got {bad}"):
            evaluate(model, data, block_size=16, batch_size=bad)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        evaluate(model, data, block_size=16, batch_size=2.0)


# --------------------------------------------------------------------------------------------
# Checkpoints.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip_gives_identical_logits(tmp_path, small_tokenizer, tie):
    model = tiny_model(small_tokenizer.vocab_size, tie=tie, seed=7)
    save_checkpoint(tmp_path / "ckpt", model, small_tokenizer, {"note": "hi", "losses": [1.5]})
    loaded, tok = load_checkpoint(tmp_path / "ckpt")
    assert not loaded.training and loaded.cfg == model.cfg
    assert tok.to_dict() == small_tokenizer.to_dict()
    idx = torch.randint(0, small_tokenizer.vocab_size, (2, 20), generator=torch.Generator())
    assert torch.equal(loaded(idx), model(idx))
    if tie:
        assert loaded.output.weight.data_ptr() == loaded.tok_embeddings.weight.data_ptr()
    assert checkpoint_metadata(tmp_path / "ckpt")["extra"] == {"note": "hi", "losses": [1.5]}


@pytest.fixture
def saved(tmp_path, small_tokenizer):
    path = tmp_path / "ckpt"
    save_checkpoint(path, tiny_model(small_tokenizer.vocab_size), small_tokenizer)
    return path


def _edit_config(path, edit):
    meta = json.loads((path / CONFIG_FILE).read_text())
    edit(meta)
    (path / CONFIG_FILE).write_text(json.dumps(meta))


def _resave_weights(path, edit):
    """Change the tensors, rewrite the file and fix the recorded hash (a consistent but
    mismatched checkpoint), so the test reaches the key and shape checks."""
    from safetensors.torch import load_file, save_file

    from tinygpt.train import _sha256
    tensors = load_file(path / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, path / WEIGHTS_FILE)
    _edit_config(path, lambda m: m.__setitem__("weights_sha256", _sha256(path / WEIGHTS_FILE)))


def test_truncated_weights(saved):
    data = (saved / WEIGHTS_FILE).read_bytes()
    (saved / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_checkpoint(saved)


def test_flipped_byte_in_weights(saved):
    data = bytearray((saved / WEIGHTS_FILE).read_bytes())
    data[-10] ^= 0xFF
    (saved / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256 differs"):
        load_checkpoint(saved)


def test_bad_json(saved):
    (saved / CONFIG_FILE).write_text('{"format": "tinygpt-checkpoint", ')
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_checkpoint(saved)


def test_missing_files(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    (saved / WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        load_checkpoint(saved)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.__setitem__("version", 99), "has version 99"),
    (lambda m: m.__setitem__("format", "other"), "is not a tinygpt-checkpoint"),
    (lambda m: m.pop("tokenizer"), r"missing the field\(s\) \['tokenizer'\]"),
    (lambda m: m["model_config"].__setitem__("d_model", 48), "wrong shape"),
    (lambda m: m["model_config"].__setitem__("n_layers", 3), "missing tensors"),
    (lambda m: m["model_config"].__setitem__("vocab_size", 999), "the tokenizer has"),
    (lambda m: m["model_config"].__setitem__("n_heads", 5), "invalid model_config"),
    (lambda m: m["model_config"].__setitem__("colour", "red"), r"unknown field\(s\) \['colour'\]"),
    (lambda m: m["tokenizer"].__setitem__("merges", "oops"), "invalid tokenizer"),
])
def test_mismatched_config(saved, edit, message):
    _edit_config(saved, edit)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(saved)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("norm.weight"), r"missing tensors \['norm.weight'\]"),
    (lambda t: t.__setitem__("extra.bias", torch.zeros(3)), r"unexpected tensors \['extra.bias'"),
    (lambda t: t.__setitem__("norm.weight", torch.ones(31)), r"norm.weight: expected \(32,\)"),
    (lambda t: t["norm.weight"].__setitem__(0, float("nan")), "non-finite values"),
])
def test_mismatched_weights(saved, edit, message):
    _resave_weights(saved, edit)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(saved)


def test_save_checkpoint_rejects_bad_arguments(tmp_path, small_tokenizer):
    model = tiny_model(small_tokenizer.vocab_size)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_checkpoint(tmp_path, model, small_tokenizer, {"x": object()})
    with pytest.raises(ValueError, match="tokenizer.vocab_size"):
        save_checkpoint(tmp_path, tiny_model(small_tokenizer.vocab_size + 1), small_tokenizer)


# --------------------------------------------------------------------------------------------
# Word probabilities from token probabilities.
# --------------------------------------------------------------------------------------------


def _word_log_prob_by_hand(model, tok, prefix, word):
    """One forward pass per token, no batching: ln P(tokens of word) + ln P(word ends)."""
    ids = [tok.eot_id] + tok.encode(prefix)
    if word == corpus.END:
        return torch.log_softmax(model(torch.tensor([ids]))[0, -1], -1)[tok.eot_id].item()
    text = word if word == "." or not prefix else " " + word
    total = 0.0
    for t in tok.encode(prefix + text)[len(ids) - 1:]:
        total += torch.log_softmax(model(torch.tensor([ids]))[0, -1], -1)[t].item()
        ids.append(t)
    probs = torch.softmax(model(torch.tensor([ids]))[0, -1], -1)
    starts = (b" ",) if word == "." else (b" ", b".")
    ends = [i for i in range(tok.vocab_size)
            if i == tok.eot_id or (i in tok.vocab and tok.vocab[i][:1] in starts)]
    return total + math.log(probs[ends].sum().item())


@pytest.mark.parametrize("prefix", ["", "The cat sat on the", "The boy saw a dog.", "A bird"])
def test_word_log_probs_match_a_token_by_token_reference(small_tokenizer, prefix):
    model = tiny_model(small_tokenizer.vocab_size, seed=11)
    words = list(corpus.next_word_distribution(prefix)) + ["chased"]
    got = model_word_log_probs(model, small_tokenizer, prefix, words)
    multi = [w for w in words if w != corpus.END
             and len(small_tokenizer.encode(" " + w)) > 1]
    assert multi, "the test should include words of several tokens"
    for word in words:
        assert got[word] == pytest.approx(
            _word_log_prob_by_hand(model, small_tokenizer, prefix, word), abs=1e-4), word


def test_word_log_probs_rejects_bad_words(small_tokenizer):
    model = tiny_model(small_tokenizer.vocab_size)
    with pytest.raises(ValueError, match="non-empty list"):
        model_word_log_probs(model, small_tokenizer, "The", [])
    with pytest.raises(ValueError, match="run of ASCII letters"):
        model_word_log_probs(model, small_tokenizer, "The", ["cat dog"])


def test_kl_divergence_by_hand():
    p = {"a": 0.5, "b": 0.5}
    q = {"a": 0.25, "b": 0.75}
    assert kl_divergence(p, q) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))
    assert kl_divergence(p, p) == 0.0
    with pytest.raises(ValueError, match="KL is infinite"):
        kl_divergence(p, {"a": 1.0})


# --------------------------------------------------------------------------------------------
# The shipped checkpoint.
# --------------------------------------------------------------------------------------------


def test_pretrained_loads_offline_in_eval_mode(pretrained):
    model, tok = pretrained
    assert isinstance(model, TinyGPT) and not model.training
    assert model.cfg.vocab_size == tok.vocab_size
    assert tok.decode(tok.encode("The cat sat on the mat.")) == "The cat sat on the mat."
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


@pytest.mark.parametrize("prompt", ["", "The cat", "A bird", "The girl saw", "The fish swam",
                                    "The dog chased a ball. It", "The boy was happy. He ran"])
def test_pretrained_greedy_text_is_grammatical(pretrained, prompt):
    model, tok = pretrained
    text = sample_text(model, tok, prompt, max_new_tokens=40)
    assert text.startswith(prompt) and text != prompt
    assert corpus.story_probability(text) > 0, f"greedy story not in the grammar: {text!r}"


def test_pretrained_sampled_stories_are_grammatical(pretrained):
    model, tok = pretrained
    text = sample_text(model, tok, "", max_new_tokens=100, temperature=1.0, seed=0,
                       stop_at_eot=False)
    stories = text.split("\n")
    assert len(stories) >= 4
    for story in stories[:-1]:  # the last one may be cut off by max_new_tokens
        assert corpus.story_probability(story) > 0, story


def test_pretrained_cat_sat_on_the(pretrained):
    model, tok = pretrained
    truth = corpus.next_word_distribution("The cat sat on the")
    dist, mass = model_next_word_distribution(model, tok, "The cat sat on the")
    assert mass > 0.99
    for word, p in truth.items():
        assert dist[word] == pytest.approx(p, abs=0.05), (word, dist)
    assert kl_divergence(truth, dist) < 0.01


def test_pretrained_kl_on_heldout_prefixes(pretrained):
    """Threshold 0.02 nats: the shipped model measures 0.0014 on these 40 prefixes (and on 500,
    see tinygpt/data/README.md), so there is a 14x margin; a model that knows which words are
    allowed but not how likely they are (uniform over the allowed words) scores 0.107 here."""
    model, tok = pretrained
    prefixes = corpus.sample_prefixes(40, seed=99)
    assert kl_to_truth(model, tok, prefixes) < 0.02
    uniform_kl = 0.0
    for prefix in prefixes:
        truth = corpus.next_word_distribution(prefix)
        uniform_kl += kl_divergence(truth, {w: 1 / len(truth) for w in truth}) / len(prefixes)
    assert uniform_kl > 0.05
    # context matters: the bird's places are not the cat's
    truth = corpus.next_word_distribution("The cat sat on the")
    bird_dist, _ = model_next_word_distribution(model, tok, "The bird sat on the")
    with pytest.raises(ValueError, match="infinite"):
        kl_divergence(truth, bird_dist)


def test_random_model_has_a_large_kl(small_tokenizer):
    model = tiny_model(small_tokenizer.vocab_size, seed=1)
    prefixes = corpus.sample_prefixes(10, seed=4)
    assert kl_to_truth(model, small_tokenizer, prefixes) > 0.1


def test_command_line_writes_a_loadable_checkpoint(tmp_path, capsys):
    from tinygpt.train import main

    threads = torch.get_num_threads()
    argv = ["--out", str(tmp_path / "cli"), "--steps", "3", "--n-stories", "300",
            "--eval-stories", "50", "--d-model", "32", "--n-layers", "1", "--d-ff", "64",
            "--block-size", "32", "--batch-size", "4", "--warmup-steps", "1",
            "--kl-prefixes", "5", "--threads", "1", "--no-progress"]
    assert main(argv) == 0
    assert torch.get_num_threads() == threads  # restored
    model, tok = load_checkpoint(tmp_path / "cli")
    extra = checkpoint_metadata(tmp_path / "cli")["extra"]
    assert extra["train_config"]["steps"] == 3 and len(extra["loss_history"]) == 3
    assert model.cfg.d_model == 32 and model.cfg.vocab_size == tok.vocab_size
    assert "weights sha256" in capsys.readouterr().out


def test_balance_loss_is_one_when_uniform_and_e_when_collapsed():
    from tinygpt.train import balance_loss

    n, e = 8, 4
    uniform = balance_loss(torch.zeros(n, e), torch.tensor([[0, 1], [2, 3]] * 4), e)
    assert torch.isclose(uniform, torch.tensor(1.0))
    collapsed = balance_loss(torch.tensor([[50.0, 0, 0, 0]] * n), torch.tensor([[0, 1]] * n), e)
    assert 1.9 < float(collapsed) < 2.1       # half the pairs on an expert holding all the mass
    one = balance_loss(torch.tensor([[50.0, 0, 0, 0]] * n), torch.zeros(n, 1, dtype=torch.long), e)
    assert torch.isclose(one, torch.tensor(float(e)))


def test_a_mixture_of_experts_trains_with_the_balance_loss():
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64,
                      max_seq_len=32, n_experts=4, top_k=2, d_expert=16)
    data = torch.arange(2000) % 7 + 3
    plain = train(TinyGPT(cfg, seed=0), data, 30, batch_size=8, block_size=16, progress=False)
    balanced_model = TinyGPT(cfg, seed=0)
    balanced = train(balanced_model, data, 30, batch_size=8, block_size=16, progress=False,
                     balance_weight=0.1)
    assert plain[0] == balanced[0]            # the reported loss is the language model's
    assert plain[-1] < plain[0] - 1 and balanced[-1] < balanced[0] - 1     # both learn
    assert plain != balanced                  # the balance term changed the gradients
    # the hooks are gone after training
    assert all(not m.gate._forward_hooks for m in balanced_model.modules() if hasattr(m, "gate"))
    with pytest.raises(ValueError, match="balance_weight must be a finite number >= 0"):
        train(TinyGPT(cfg, seed=0), data, 1, balance_weight=-1.0, progress=False)
    dense = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                        max_seq_len=32)        # it divided by its zero MoE layers
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        train(TinyGPT(dense, seed=0), data, 1, balance_weight=0.1, progress=False)


@pytest.mark.parametrize("kwargs,match", [
    ({"lr": math.inf}, "finite lr > 0"), ({"lr": math.nan}, "finite lr > 0"),
    ({"weight_decay": math.nan}, "weight_decay must be a finite number >= 0"),
    ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0"),
    ({"balance_weight": math.inf}, "balance_weight must be a finite number >= 0")])
def test_train_refuses_rates_that_make_the_loss_nan(kwargs, match):
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                      max_seq_len=32)
    with pytest.raises(ValueError, match=match):
        train(TinyGPT(cfg, seed=0), torch.arange(200) % 7, 1, progress=False, **kwargs)


def test_experts_by_word_class_counts_every_token_and_slot():
    from tinygpt.train import experts_by_word_class, load_pretrained

    _, tokenizer = load_pretrained()
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=2,
                      n_kv_heads=1, d_ff=64, max_seq_len=16, n_experts=4, top_k=2, d_expert=16,
                      dense_layers=(0,))
    model = TinyGPT(cfg, seed=0)
    stories = corpus.generate_corpus(6, seed=4).split("\n")
    table = experts_by_word_class(model, tokenizer, stories)
    assert list(table) == [1]                                  # layer 0 is dense
    ids = torch.cat([torch.tensor(tokenizer.encode(s)) for s in stories])
    words = [tokenizer.decode([int(i)]).strip() for i in ids]
    n_tokens = sum(1 for w in words if w)                      # every token but the separators
    per_class = {name: int(c.sum()) for name, c in table[1].items()}
    assert sum(per_class.values()) >= 2 * n_tokens            # k = 2 slots per token (+ "end")
    assert per_class["noun"] == 2 * sum(corpus.WORD_CLASS.get(w) == "noun" for w in words)
    assert set(per_class) <= set(corpus.WORD_CLASS.values()) | {"end"}
    # the counts are the chosen experts of the model's own forward, window by window
    full = encode_stories(stories, tokenizer)
    chosen = []
    for start in range(0, len(full), 16):
        model(full[start:start + 16][None])
        chosen.append(model.layers[1].feed_forward.last_experts)
    chosen = torch.cat(chosen)                                 # (N, k) expert ids
    assert int(table[1]["period"].sum()) == 2 * sum(1 for w in words if w == ".")
    assert sum(int(c.sum()) for c in table[1].values()) == chosen.numel()
    assert torch.equal(sum(table[1].values()), torch.bincount(chosen.reshape(-1), minlength=4))
    classes = [corpus.WORD_CLASS.get(tokenizer.decode([int(i)]).strip(), "end") for i in full]
    for name, counts in table[1].items():
        rows = torch.tensor([c == name for c in classes])
        assert torch.equal(counts, torch.bincount(chosen[rows].reshape(-1), minlength=4)), name
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        experts_by_word_class(TinyGPT(ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32,
                                                  n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                                                  max_seq_len=16)), tokenizer, stories)


@pytest.mark.parametrize("device,match", [("cpu:1", "the CPU is one device here"),
                                          ("gpu", "device must be one of")])
def test_load_pretrained_refuses_a_device_this_machine_lacks(device, match):
    # cpu:1 was accepted; cuda on a CPU-only torch was an AssertionError from inside torch
    from tinygpt.train import load_pretrained

    with pytest.raises(ValueError, match=match):
        load_pretrained(device)
    assert load_pretrained("cpu")[0].tok_embeddings.weight.device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_load_pretrained_on_cuda_without_cuda_says_so():
    from tinygpt.train import load_pretrained

    with pytest.raises(ValueError, match="device cuda: CUDA is not available here"):
        load_pretrained("cuda")
