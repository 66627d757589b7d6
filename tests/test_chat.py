"""tinygpt.chat on the shipped tiny model (fast): the loop's commands and the history that
is dropped, oldest turn first, when the conversation outgrows the context. The real model's
chat runs in tests/test_real_model.py."""

import io
import re

import pytest

from tinygpt.chat import fit_history, main
from tinygpt.loading import load_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tinygpt")[1]


def turns(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"the cat sat {i}"}
            for i in range(n)]


def test_fit_history_drops_the_oldest_turns_and_keeps_the_system_message(tokenizer):
    messages = [{"role": "system", "content": "be brief"}] + turns(7)
    full = len(tokenizer.encode_chat(messages))
    ids, dropped = fit_history(tokenizer, messages, full)
    assert dropped == 0 and len(ids) == full and len(messages) == 8
    ids, dropped = fit_history(tokenizer, messages, full - 1)
    assert dropped == 1 and messages[0]["role"] == "system"
    assert messages[1]["content"] == "the cat sat 1" and len(ids) < full
    assert ids == tokenizer.encode_chat(messages)
    with pytest.raises(ValueError, match="at most 3 fit"):
        fit_history(tokenizer, messages, 3)


def chat(stdin: io.StringIO) -> tuple[str, list[str]]:
    """The loop's output at temperature 0, and its replies in order."""
    out = io.StringIO()
    assert main(["--model", "tinygpt", "--temperature", "0", "--max-tokens", "5"],
                stdin=stdin, stdout=out) == 0
    text = out.getvalue()
    return text, [part.split("\n\nyou> ")[0] for part in text.split("tinygpt> ")[1:]]


def test_the_loop_answers_resets_and_quits():
    stdin = io.StringIO("The cat\n\n/reset\nThe dog\n/quit\nnever read\n")
    text, replies = chat(stdin)
    assert len(replies) == 2 and "(conversation cleared)" in text
    assert "never read" not in text
    assert stdin.read() == "never read\n"                 # /quit stopped reading
    # after /reset the reply is a fresh session's (with "The cat" still in the history the
    # tiny model answers "The dog" differently)
    assert chat(io.StringIO("The dog\n"))[1] == [replies[1]]


def test_bad_arguments_are_refused():
    assert main(["--model", "tinygpt", "--max-tokens", "0"], stdin=io.StringIO()) == 2
    assert main(["--model", "no-such-model"], stdin=io.StringIO()) == 2
    assert main(["--model", "tinygpt", "--max-tokens", "100000"], stdin=io.StringIO()) == 2


@pytest.mark.parametrize("threads", ["0", "100000", "99999999999999999999999"])
def test_a_thread_count_torch_cannot_take_is_refused_before_the_model_loads(
        monkeypatch, capsys, threads):
    """100000 threads crashed the process (a segfault) and 10**23 overflowed in torch."""
    import tinygpt
    import tinygpt.loading

    def load_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded before --threads was refused")

    monkeypatch.setattr(tinygpt.loading, "load_model", load_model)
    assert main(["--model", "tinygpt", "--threads", threads], stdin=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --threads must be an integer from 1 to "
                   f"{4 * tinygpt.usable_cores()} (4 per usable core, "
                   f"{tinygpt.usable_cores()} here), got {threads}\n")


@pytest.mark.parametrize("flag,value,field", [
    ("--top-p", "0", "top_p"), ("--temperature", "-1", "temperature"),
    ("--max-tokens", "0", "max_new_tokens"), ("--seed", "-1", "seed")])
def test_errors_name_the_flag_not_the_field(capsys, flag, value, field):
    """`chat --top-p 0` printed "top_p must be in (0, 1]": only max_new_tokens was renamed."""
    assert main(["--model", "tinygpt", flag, value], stdin=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} must be"), err
    assert not re.search(rf"(?<![-\w]){field}\b", err), err       # the field, not in a flag
