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
