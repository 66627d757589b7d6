"""Day 21's prose quotes numbers its cells print: each must still be in the saved outputs.

The notebook reads tinygpt.long_context, tinygpt.mla, tinygpt.paged and SmolLM2; when one of
them changes what it computes (a perplexity, a byte count), re-executing the notebook changes
the outputs, and the markdown must follow. This test fails until it does.
"""

from __future__ import annotations

from autograder.notebooks import read, solution_path

DAY = "day21_long_context"

# markdown cell id -> the numbers it quotes, each as a code cell above it prints it
QUOTED = {
    "bytes-after": ["16.00", "15.0 GiB", "64.00", "2.00", "1.34 GB", "10.7 GB", "0.536", "8.58",
                    "10.41", "62.00", "507,904"],
    "mla-after": ["70,272", "71.1x", "4,997,120", "8.6 GiB", "610 GiB"],
    "blocks-after": ["64 blocks", "16 blocks", "at most 17", "8 blocks", "at most 9", "0.54 GB",
                     "4.29 GB"],
    "sinks-after": ["11.96", "5.22", "7.79"],
    "rope-after": ["29/64", "19/64", "1.2079", "145,874,144"],
    "fp8-after": ["0.0263", "0.0092", "12,240", "11,520", "23,040", "87,724", "93,205", "46,603"],
}
# how the prose writes a few of them
IN_PROSE = {"29/64": "29", "19/64": "19", "0.0263": "2.63%", "0.0092": "0.92%",
            "15.0 GiB": "15.0 GiB", "at most 17": "17 at most", "at most 9": "9 at", "64 blocks":
            "64 blocks", "16 blocks": "16 blocks", "8 blocks": "8 for a window"}


def test_the_prose_quotes_what_the_cells_printed():
    nb = read(solution_path(DAY))
    ids = [cell.get("id") for cell in nb.cells]
    missing = []
    for cell_id, numbers in QUOTED.items():
        index = ids.index(cell_id)
        prose = nb.cells[index].source.replace("\n", " ")
        printed = "".join(out.get("text", "") for cell in nb.cells[:index]
                          if cell.cell_type == "code" for out in cell.outputs)
        for number in numbers:
            if number not in printed:
                missing.append(f"{cell_id}: {number!r} is not in the outputs above it")
            if IN_PROSE.get(number, number) not in prose:
                missing.append(f"{cell_id}: the prose no longer quotes {number!r}")
    assert not missing, ("re-execute the notebook and update its prose: " + "; ".join(missing))
