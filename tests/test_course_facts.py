"""Facts the course states, tied to their sources so a change on either side fails here.

Each test recomputes a figure the notebooks, README or docstrings state (or a claim they were
corrected to avoid) from the source of truth: the shipped checkpoint's config, the package's
own functions, or torch.
"""

import math
import re
from pathlib import Path

import torch

from autograder.notebooks import read, solution_path
from autograder.settings import REPO_ROOT
from tinygpt import flops
from tinygpt.model import ModelConfig
from tinygpt.train import PRETRAINED_DIR, checkpoint_metadata


def _shipped() -> ModelConfig:
    return ModelConfig(**checkpoint_metadata(PRETRAINED_DIR)["model_config"])


def _text(day: str, cell_type: str | None = None) -> str:
    cells = read(solution_path(day)).cells
    return "\n".join(c.source for c in cells if cell_type is None or c.cell_type == cell_type)


def _outputs(day: str) -> str:
    parts = []
    for cell in read(solution_path(day)).cells:
        for out in cell.get("outputs", []):
            parts.append(str(out.get("text", "")) + str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


# ---- the shipped model's shape: one source, tinygpt/data/config.json ----------------------------

def test_flops_preset_is_the_shipped_checkpoint():
    meta = checkpoint_metadata(PRETRAINED_DIR)
    assert flops.PRESETS["tinygpt"] == _shipped()
    assert flops.param_count(flops.PRESETS["tinygpt"]) == meta["extra"]["n_parameters"]


def test_notebooks_build_the_course_model_from_the_shipped_config():
    for day, name in [("day05_model", "TINY"), ("day09_flops", "TINY"), ("day10_roofline", "TINY"),
                      ("day11_kv_cache", "CFG")]:
        code = _text(day, "code")
        assert (f'{name} = ModelConfig(**checkpoint_metadata(PRETRAINED_DIR)["model_config"])'
                in code), f"{day}: {name} should be read from the shipped config"
    cfg, total = _shipped(), flops.param_count(_shipped())
    for day in ["day05_model", "day09_flops", "day10_roofline", "day11_kv_cache", "day12_bench"]:
        text = _text(day)
        assert "vocab_size=512, d_model=128" not in text, f"{day}: a retyped course-model shape"
        assert "512-token vocabulary" not in text
        assert "869,504" not in text and "869504" not in _outputs(day)
    assert f"{total:,} parameters" in _outputs("day09_flops")
    assert f"V={cfg.vocab_size:>6}" in _outputs("day09_flops")


def test_day09_worked_examples_are_the_shipped_models_numbers():
    cfg, md = _shipped(), _text("day09_flops", "markdown")
    parts = flops.param_breakdown(cfg)
    assert str(parts) in md.replace("`", "")
    assert f"`weight_flops_per_token(TINY)` is {flops.weight_flops_per_token(cfg):,}" in md
    assert f"`prefill_flops(TINY, 2, 16)` is {flops.prefill_flops(cfg, 2, 16):,}" in md
    assert f"`decode_flops(TINY, 8, 100)` is {flops.decode_flops(cfg, 8, 100):,}" in md
    code = _text("day09_flops", "code")
    for value in (flops.weight_flops_per_token(cfg), flops.prefill_flops(cfg, 2, 16),
                  flops.decode_flops(cfg, 8, 100)):
        assert f"{value:_}" in code


# ---- day 07: the temperature example ------------------------------------------------------------

def test_day07_mat_at_half_temperature():
    logits = torch.tensor([[2.0, -1.5, 0.3, 4.2, -0.8]])   # LOGITS of day 07
    mat = float(torch.softmax(logits / 0.5, dim=-1)[0, 3])
    assert 0.9 < mat < 0.988            # the prose says "more than 0.9"; 0.988 was the wrong figure
    md = _text("day07_sampling", "markdown")
    assert "alone holds more\n  than 0.9 of the mass" in md
    assert "0.988" not in md
    assert f"{mat:.4f}" in _outputs("day07_sampling")   # the cell under the prose prints it


# ---- day 05: bfloat16's precision ---------------------------------------------------------------

def test_day05_bfloat16_digits():
    bits = -int(math.log2(torch.finfo(torch.bfloat16).eps)) + 1      # 7 stored + the implicit 1
    assert bits == 8
    assert f"{bits * math.log10(2):.1f}" == "2.4"
    assert "only 8 significant bits, about 2.4 decimal digits" in _text("day05_model", "markdown")


# ---- day 11: what an uncached step costs --------------------------------------------------------

def test_day11_hundredth_token_claim_needs_a_one_token_prompt():
    cfg = _shipped()
    # Without a cache, step n runs the model over the whole context so far.
    from_one = flops.prefill_flops(cfg, 1, 100) / flops.prefill_flops(cfg, 1, 1)
    from_fifty = flops.prefill_flops(cfg, 1, 149) / flops.prefill_flops(cfg, 1, 50)
    assert 95 < from_one < 120          # "about a hundred times", from a one-token prompt
    assert from_fifty < 4               # why the prose must say which prompt
    assert "from a one-token prompt, the hundredth\ntoken costs about a hundred times" in _text(
        "day11_kv_cache", "markdown")


def test_no_unmeasured_one_core_claim():
    places = {"README.md": (REPO_ROOT / "README.md").read_text(),
              "tinygpt/kv_cache.py": (REPO_ROOT / "tinygpt" / "kv_cache.py").read_text(),
              "day11": _text("day11_kv_cache"), "day12": _text("day12_bench")}
    for where, text in places.items():
        assert not re.search(r"(uses|on) one core|whose product uses (every|both) cores?", text), \
            f"{where} repeats the one-core claim, which measurement does not support"


# ---- day 12: who reports goodput ----------------------------------------------------------------

def test_day12_does_not_say_every_engine_reports_goodput():
    first = read(solution_path("day12_bench")).cells[0].source
    assert "Every serving engine" not in first
    assert "vLLM's benchmark reports it too" in first


def test_every_path_the_tests_read_exists():
    days = set(re.findall(r'"(day\d\d_\w+)"', Path(__file__).read_text()))   # this file's
    assert len(days) >= 6
    paths = [solution_path(day) for day in sorted(days)] + [
        Path(PRETRAINED_DIR, "config.json"), REPO_ROOT / "README.md",
        REPO_ROOT / "tinygpt" / "kv_cache.py"]
    missing = [str(path) for path in paths if not path.is_file()]
    assert not missing, f"missing: {missing}"


# ---- the README's speed table: every ratio agrees with the figures printed beside it ---------

SPEED_ROW = re.compile(r"(?P<ratio>\d+(?:\.\d+)?)x(?P<between>[^(|]*)\((?P<between2>[^|]*?)"
                       r"(?P<a>[\d,]+(?:\.\d+)?) vs (?P<b>[\d,]+(?:\.\d+)?) tokens/s")
STATISTIC_NAMED = "median of the per-round"


def _speed_table_rows() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("## Speed targets: measured results", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|") and "tokens/s" in line]


def test_readme_speed_ratios_agree_with_their_tokens_per_second():
    """'2.14x (818 vs 382 tokens/s)': 818 / 382 must round to 2.14, within what the rounding of
    the printed figures allows; a row whose ratio is another statistic (a median of per-round
    ratios) must say so beside the figures."""
    rows = _speed_table_rows()
    checked, wrong = 0, []
    for row in rows:
        for m in SPEED_ROW.finditer(row):
            ratio = float(m["ratio"])
            a, b = (float(m[k].replace(",", "")) for k in ("a", "b"))
            # the printed figures are rounded: half a unit of their last digit either way
            da = 0.5 * 10 ** -(len(m["a"].split(".")[1]) if "." in m["a"] else 0)
            db = 0.5 * 10 ** -(len(m["b"].split(".")[1]) if "." in m["b"] else 0)
            low, high = (a - da) / (b + db), (a + da) / (b - db)
            half = 0.5 * 10 ** -(len(m["ratio"].split(".")[1]) if "." in m["ratio"] else 0)
            checked += 1
            if not low - half <= ratio <= high + half and STATISTIC_NAMED not in m.group(0):
                wrong.append(f"{m.group(0)!r}: {a:g} / {b:g} = {a / b:.3f}")
    assert checked >= 5, f"the speed table changed shape: only {checked} ratios found in {rows}"
    assert not wrong, ("README speed table: a ratio disagrees with the tokens/s beside it (state "
                       f"which statistic it is): {wrong}")
