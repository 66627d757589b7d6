"""tinygpt.loading on bad input: a Hugging Face folder whose config.json, weights or tokenizer
files cannot be read or parsed is a ValueError naming the file (and what is wrong with it),
an empty model name is refused with the allowed forms, and the chat and serve commands print
either as one `error:` line with exit code 2, never a traceback. The folders are built in
tmp_path."""

from __future__ import annotations

import io
import json

import pytest
import torch

from tinygpt.chat import main as chat_main
from tinygpt.loading import load_model
from tinygpt.server.cli import main as serve_main

WORDS = ["<unk>", "<s>", "</s>", "the", "cat", "sat"]


def llama_folder(path):
    """A tiny random Llama saved the Hugging Face way, with a word-level tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                                     eos_token="</s>")
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=16,
                                      intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def junk_weights_folder(path, weights: bytes = b"junk"):
    """config.json says llama; the only .safetensors file is not one."""
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(weights)
    return path


@pytest.mark.parametrize("weights", [b"junk", b"", b"\x08" + bytes(7) + b'{"a": 1}'])
def test_weights_that_are_no_safetensors_file_are_named(tmp_path, weights):
    folder = junk_weights_folder(tmp_path / "model", weights)
    with pytest.raises(ValueError, match="not a readable safetensors file") as caught:
        load_model(folder)
    assert str(folder / "model.safetensors") in str(caught.value)


def test_truncated_weights_of_a_real_folder_are_named(tmp_path):
    folder = llama_folder(tmp_path / "model")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match="not a readable safetensors file") as caught:
        load_model(folder)
    assert str(weights) in str(caught.value)


@pytest.mark.parametrize("text", [b"not json", b"\xff\xfe{}", b""])
def test_a_config_json_that_does_not_parse_is_named(tmp_path, text):
    (tmp_path / "config.json").write_bytes(text)
    with pytest.raises(ValueError, match="is not valid JSON") as caught:
        load_model(tmp_path)
    assert str(tmp_path / "config.json") in str(caught.value)


def test_a_model_type_that_is_no_string_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": ["llama"]}))
    with pytest.raises(ValueError, match="model_type must be a string") as caught:
        load_model(tmp_path)
    assert str(tmp_path / "config.json") in str(caught.value)


def test_a_config_the_model_cannot_be_built_from_is_named(tmp_path):
    folder = llama_folder(tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size") as caught:
        load_model(folder)
    assert str(folder / "config.json") in str(caught.value)


@pytest.mark.parametrize("change,match", [
    # a TypeError before (a traceback from serve), or a silent replacement
    ({"rope_parameters": {"rope_type": "default", "rope_theta": [1]}}, "rope_theta must be a "
                                                                       "finite number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta must be a "
                                                                     "finite number > 0, got 0"),
    ({"rope_parameters": [10000.0]}, "rope_parameters must be null or a dict"),
    ({"rope_parameters": None, "rope_theta": "abc"}, "rope_theta must be a finite number"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"hidden_size": "16"}, "d_model must be a positive integer"),
])
def test_config_fields_of_the_wrong_type_are_named(tmp_path, change, match):
    folder = llama_folder(tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=match) as caught:
        load_model(folder)
    assert str(folder / "config.json") in str(caught.value)


def test_the_allowed_forms_read_right_on_the_command_line(capsys):
    """They said "None or 'tinygpt'", which no command line can pass."""
    assert serve_main(["--model", "no-such-model"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "allowed: 'tinygpt' (the shipped checkpoint, also loaded when no name is given)" \
        in line and "None" not in line


@pytest.mark.parametrize("name,text", [("tokenizer.json", "junk"), ("tokenizer.json", "{}"),
                                       ("tokenizer.json", "[]"),
                                       ("tokenizer_config.json", "[]")])
def test_tokenizer_files_that_cannot_be_read_are_named(tmp_path, name, text):
    folder = llama_folder(tmp_path / "model")
    (folder / name).write_text(text)
    with pytest.raises(ValueError, match="cannot load the tokenizer") as caught:
        load_model(folder)
    assert str(folder) in str(caught.value) and name in str(caught.value)


def test_a_folder_without_tokenizer_files_says_so(tmp_path):
    # transformers' own message blamed missing sentencepiece / tiktoken, over five lines
    folder = llama_folder(tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="holds no tokenizer files .one of tokenizer.json, "):
        load_model(folder)


def test_chat_refuses_a_model_without_a_chat_template_at_start(tmp_path, capsys):
    # it started, then answered every message with "(not sent: ... use /v1/completions)"
    folder = llama_folder(tmp_path / "model")
    capsys.readouterr()                          # (saving the folder draws a progress bar)
    out = io.StringIO()
    assert chat_main(["--model", str(folder), "--max-tokens", "4"], stdin=io.StringIO("hi\n"),
                     stdout=out) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "has no chat template, so it cannot chat" in line and out.getvalue() == ""


def test_an_empty_model_name_is_refused_not_read_as_the_current_folder(tmp_path, monkeypatch):
    llama_folder(tmp_path)                    # the current folder holds a loadable model
    monkeypatch.chdir(tmp_path)
    assert load_model(".")[2].model_id == tmp_path.name
    with pytest.raises(ValueError, match="the model name is empty; allowed: .*'tinygpt'"):
        load_model("")


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_chat_and_serve_print_a_bad_folder_as_one_error_line(tmp_path, capsys):
    folder = junk_weights_folder(tmp_path / "model")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text("not json")
    # serve on port 0: the default port may be taken by another test's server (exit 1)
    for main in (lambda argv: chat_main(argv, stdin=io.StringIO("hi\n"), stdout=io.StringIO()),
                 lambda argv: serve_main([*argv, "--port", "0"])):
        assert main(["--model", str(folder)]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert str(folder / "model.safetensors") in line and "safetensors" in line
        assert main(["--model", str(tmp_path / "text")]) == 2
        assert str(tmp_path / "text" / "config.json") in one_error_line(capsys.readouterr().err)
        assert main(["--model", ""]) == 2
        assert "the model name is empty" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("name", ["tinygpt", "smollm2", "absent.gguf"])
def test_dtype_and_max_seq_len_are_checked_before_anything_is_read(name):
    """max_seq_len=1.5 loaded a model with max_seq_len 1 (True gave 1, "64" gave 64), and
    dtype="float16" failed in Module.to as "Invalid device string"."""
    for bad in ("float16", torch.int8, float):
        with pytest.raises(TypeError, match="dtype must be None or a floating torch.dtype"):
            load_model(name, dtype=bad)
    for bad in (1.5, True, "64"):
        with pytest.raises(TypeError, match="max_seq_len must be None or an int"):
            load_model(name, max_seq_len=bad)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_seq_len must be >= 1"):
            load_model(name, max_seq_len=bad)


def test_load_gguf_checks_them_too(tmp_path):
    from tinygpt.loading import load_gguf

    with pytest.raises(TypeError, match="max_seq_len must be None or an int"):
        load_gguf(tmp_path / "absent.gguf", max_seq_len=64.0)
    with pytest.raises(TypeError, match="dtype must be None or a floating torch.dtype"):
        load_gguf(tmp_path / "absent.gguf", dtype="bfloat16")
