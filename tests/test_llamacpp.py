"""`make bench-llamacpp`'s GGUF files: llama.cpp (when llama-cpp-python is installed; skipped
otherwise) computes the same logits from them as tinygpt from the model they were written
from, and tinygpt reads the Q4_1 blocks back unchanged."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from tinygpt import cpu_kernels as ck
from tinygpt.model import ModelConfig, TinyGPT

gguf = pytest.importorskip("gguf")


def llama_cpp_or_skip():
    """llama_cpp, or a skip with the reason it cannot run here (not installed, or built for
    another CPU: tinygpt.bench.llamacpp.unavailable imports it in a child process first)."""
    from tinygpt.bench.llamacpp import unavailable

    if (why := unavailable()) is not None:
        pytest.skip(why)
    import llama_cpp

    return llama_cpp


def model() -> TinyGPT:
    cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_ff=256, max_seq_len=256, rope_base=1e5, tie_embeddings=True)
    m = TinyGPT(cfg, seed=0).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(5)                       # sharper logits than the initialization's
    return m


def test_q4_1_blocks_read_back_from_the_file_are_the_written_ones(tmp_path):
    from tinygpt.bench.llamacpp import q4_1_blocks, write_gguf

    m = model()
    write_gguf(m, tmp_path / "q.gguf", "Q4_1")
    blocks = q4_1_blocks(tmp_path / "q.gguf", m)
    wq = m.layers[1].attention.wq.weight
    assert all(torch.equal(a, b) for a, b in zip(blocks["layers.1.attention.wq.weight"],
                                                 ck.quantize_q4_1(wq), strict=True))
    assert len(blocks) == 7 * 2 + 1                         # every linear and the tied head


def test_llama_cpp_computes_the_same_logits_from_the_f32_file(tmp_path):
    llama_cpp = llama_cpp_or_skip()
    from tinygpt.bench.llamacpp import write_gguf

    m = model()
    write_gguf(m, tmp_path / "f32.gguf", "F32")
    llm = llama_cpp.Llama(model_path=str(tmp_path / "f32.gguf"), n_ctx=64, n_threads=1,
                          verbose=False, logits_all=True)
    prompt = [5, 17, 300, 42, 7]
    llm.eval(prompt)
    theirs = np.array(llm.scores[:len(prompt)])
    with torch.no_grad():
        ours = m(torch.tensor([prompt]))[0].numpy()
    # llama.cpp keeps its KV cache in float16: agreement to 0.1% of the logits' scale
    assert np.abs(theirs - ours).max() <= 1e-3 * np.abs(ours).max()
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()


def test_llama_batched_decodes_every_sequence_as_tinygpt_does_alone(tmp_path):
    """The engine row's reference: llama.cpp with several sequences in each decode gives each
    the greedy tokens tinygpt's batch-1 generate() gives it."""
    llama_cpp_or_skip()
    from tinygpt.bench.llamacpp import llama_batched, write_gguf
    from tinygpt.generate import generate
    from tinygpt.sampling import SamplingParams

    m = model()
    write_gguf(m, tmp_path / "f32.gguf", "F32")
    prompts = [[5, 17, 300], [42, 7, 1, 2, 3, 99], [9]]
    seconds, outputs = llama_batched(tmp_path / "f32.gguf", prompts, 6, 1)
    assert seconds > 0 and len(outputs) == len(prompts)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == generate(m, prompt, params).token_ids


def test_a_llama_cpp_built_for_another_cpu_is_reported_not_fatal(tmp_path, monkeypatch):
    """A llama_cpp whose import dies on an illegal instruction (a wheel compiled for another
    CPU) makes the llama.cpp rows say why instead of killing the benchmark."""
    from tinygpt.bench import llamacpp

    fake = tmp_path / "llama_cpp"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    llamacpp._probe.cache_clear()
    try:
        why = llamacpp.unavailable()
    finally:
        llamacpp._probe.cache_clear()
    assert why is not None and "SIGILL" in why and "another CPU" in why
    monkeypatch.setitem(sys.modules, "llama_cpp", None)          # an import made to fail
    assert llamacpp.unavailable() == "llama_cpp is not installed"
