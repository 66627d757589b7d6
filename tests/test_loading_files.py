"""tinygpt.loading.weight_files and load_hf_folder on sharded and cluttered folders: the
index's weight_map says which safetensors files are the model's (a missing shard is named,
a stray file beside them is not read), and a tensor found in two files is refused naming
both, never silently taken from the later one."""

from __future__ import annotations

import json

import pytest
import torch

from tinygpt.loading import INDEX_FILE, load_model, weight_files

safetensors_torch = pytest.importorskip("safetensors.torch")
from tests.test_loading_errors import llama_folder  # noqa: E402


def shard(folder):
    """Split the folder's model.safetensors into two shards with an index, as
    save_pretrained does for a large model."""
    tensors = safetensors_torch.load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in parts.items():
        safetensors_torch.save_file({k: tensors[k] for k in keys}, folder / file)
    weight_map = {k: file for file, keys in parts.items() for k in keys}
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_a_sharded_folder_loads_the_files_its_index_names(tmp_path):
    folder = llama_folder(tmp_path / "model")
    whole, _, _ = load_model(folder)
    shard(folder)
    model, _, _ = load_model(folder)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(),
                                                 model.state_dict().values(), strict=True))
    # a stray file beside the shards is not the model's: not read, even with a known key
    safetensors_torch.save_file({"model.norm.weight": torch.zeros(16)},
                                folder / "zz.safetensors")
    assert [f.name for f in weight_files(folder)] == ["model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors"]
    model, _, _ = load_model(folder)
    assert torch.equal(model.norm.weight, whole.norm.weight)


def test_a_missing_shard_is_named(tmp_path):
    folder = llama_folder(tmp_path / "model")
    shard(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks the shards "
                                                r"\['model-00002-of-00002\.safetensors'\]"):
        load_model(folder)


@pytest.mark.parametrize("index", ["{", "[]", '{"weight_map": {"a": "../x.safetensors"}}'])
def test_an_index_that_is_no_index_is_named(tmp_path, index):
    folder = llama_folder(tmp_path / "model")
    (folder / INDEX_FILE).write_text(index)
    with pytest.raises(ValueError, match=INDEX_FILE):
        load_model(folder)


def test_a_tensor_in_two_files_is_refused_naming_both(tmp_path):
    """The later file won silently before (zz.safetensors' zero norm weight)."""
    folder = llama_folder(tmp_path / "model")
    safetensors_torch.save_file({"model.norm.weight": torch.zeros(16)},
                                folder / "zz.safetensors")
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is in both .*model\.safetensors "
                                         r"and .*zz\.safetensors"):
        load_model(folder)


def write_json(file, value):
    file.write_text(json.dumps(value))


def test_a_folder_stops_at_the_eos_ids_its_generation_config_lists(tmp_path):
    """Llama-3-Instruct's tokenizer ends texts with <|end_of_text|> while its turns end with
    <|eot_id|>, which only generation_config.json lists; only the tokenizer's EOS stopped a
    reply before, so chat replies ran past the end of the turn."""
    folder = llama_folder(tmp_path / "model")
    write_json(folder / "generation_config.json", {"eos_token_id": [5, 2, 5]})
    info = load_model(folder)[2]
    assert info.eos_ids == info.end_of_turn_ids == (2, 5)      # the tokenizer's "</s>" first
    # without generation_config.json, config.json's list (an int there is one id)
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    write_json(folder / "config.json", {**config, "eos_token_id": [3, 4]})
    assert load_model(folder)[2].eos_ids == (2, 3, 4)
    write_json(folder / "config.json", {**config, "eos_token_id": 4})
    assert load_model(folder)[2].end_of_turn_ids == (2, 4)
    # a generation_config.json without the field leaves config.json's
    write_json(folder / "generation_config.json", {"do_sample": True})
    assert load_model(folder)[2].eos_ids == (2, 4)


@pytest.mark.parametrize("file,value", [
    ("generation_config.json", [2, 6]), ("generation_config.json", "2"),
    ("generation_config.json", [True]), ("generation_config.json", {"id": 2}),
    ("generation_config.json", [2.0]), ("config.json", -1), ("config.json", [2, 6])])
def test_a_malformed_eos_token_id_is_named_with_its_file(tmp_path, file, value):
    folder = llama_folder(tmp_path / "model")
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    write_json(folder / file, {**(config if file == "config.json" else {}),
                               "eos_token_id": value})
    with pytest.raises(ValueError, match=r"eos_token_id must be null, a token id or a list of "
                                         r"token ids \(ints in \[0, 6\)\), got") as caught:
        load_model(folder)
    assert f"{folder / file}: eos_token_id" in str(caught.value)


@pytest.mark.parametrize("text", ["not json", "[2]"])
def test_a_generation_config_that_is_no_json_object_is_named(tmp_path, text):
    folder = llama_folder(tmp_path / "model")
    (folder / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match="generation_config.json (is not valid JSON|must hold "
                                         "a JSON object)") as caught:
        load_model(folder)
    assert str(folder / "generation_config.json") in str(caught.value)


def test_an_unsupported_post_processor_is_named_with_the_folder(tmp_path):
    """`serve` printed "the tokenizer puts [1] before a text and [2] after it ..." without
    saying which folder's tokenizer."""
    from tokenizers import Tokenizer, processors

    folder = llama_folder(tmp_path / "model")
    core = Tokenizer.from_file(str(folder / "tokenizer.json"))
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    core.save(str(folder / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"the tokenizer puts \[1\] before a text and \[2\] "
                                         r"after it") as caught:
        load_model(folder)
    assert f"{folder}: the tokenizer its files (" in str(caught.value)
    assert "tokenizer.json" in str(caught.value)
