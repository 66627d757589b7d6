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


def run_chat(argv: list[str], stdin, stdout) -> int:
    """main's status; a KeyboardInterrupt that escapes it fails this test alone (pytest would
    otherwise stop the whole session)."""
    try:
        return main(argv, stdin=stdin, stdout=stdout)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the chat loop")


class Interrupting(io.StringIO):
    """stdin whose readline raises KeyboardInterrupt (Ctrl-C at the prompt) once its lines
    are read."""

    def readline(self, *args):
        line = super().readline(*args)
        if not line:
            raise KeyboardInterrupt
        return line


def test_ctrl_c_during_a_reply_stops_it_and_keeps_the_part_written(monkeypatch):
    """Ctrl-C printed a KeyboardInterrupt traceback and killed the chat (exit -2). During a
    reply it now stops that reply and the loop asks for the next line; the part written
    stays in the conversation, a reply stopped before its first token is dropped with its
    question."""
    import tinygpt.chat
    import tinygpt.generate

    real_stream, interrupt_after = tinygpt.generate.stream, [2, 0]
    seen: list[list[dict]] = []

    def stream(*args, **kwargs):          # the first reply stopped after 2 tokens, the next
        after = interrupt_after.pop(0) if interrupt_after else None      # before any
        for i, event in enumerate(real_stream(*args, **kwargs)):
            if i == after:
                raise KeyboardInterrupt
            yield event

    def fit_history(tokenizer, messages, budget):
        seen.append([dict(m) for m in messages])
        return real_fit(tokenizer, messages, budget)

    real_fit = tinygpt.chat.fit_history
    monkeypatch.setattr(tinygpt.generate, "stream", stream)
    monkeypatch.setattr(tinygpt.chat, "fit_history", fit_history)
    out = io.StringIO()
    assert run_chat(["--model", "tinygpt", "--temperature", "0", "--max-tokens", "5"],
                    io.StringIO("The cat\nThe dog\nA bird\n/quit\n"), out) == 0
    text = out.getvalue()
    assert "(reply stopped; the part written is kept)" in text
    assert "(reply stopped; the question is dropped)" in text
    assert "Traceback" not in text
    partial = seen[1][1]
    assert partial["role"] == "assistant" and partial["content"]         # 2 tokens' text
    assert [m["content"] for m in seen[2]] == ["The cat", partial["content"], "A bird"]


def test_ctrl_c_at_the_prompt_leaves_quietly_with_130():
    out = io.StringIO()
    assert run_chat(["--model", "tinygpt", "--temperature", "0", "--max-tokens", "3"],
                    Interrupting("The cat\n"), out) == 130
    assert out.getvalue().endswith("\nyou> \n")              # the prompt's line ended
    assert chat(io.StringIO("The cat\n"))[1][0] in out.getvalue()      # the reply came first


def test_a_max_tokens_that_leaves_the_template_no_room_is_refused_at_the_start(capsys):
    """`--max-tokens 1023` started the chat and then refused every message as too long."""
    for argv, needed in ((["--max-tokens", "1023"], 5),
                         (["--max-tokens", "1019", "--system", "be brief"], 0)):
        stdin = io.StringIO("hi\n")
        assert main(["--model", "tinygpt", *argv], stdin=stdin, stdout=io.StringIO()) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {argv[0]} {argv[1]} leaves ") and err.count("\n") == 1
        assert "--system message" in err if "--system" in argv else "--system" not in err
        if needed:
            assert "one-word message in the chat template take 5: --max-tokens must be at " \
                   "most 1019" in err
        assert stdin.read() == "hi\n"                    # nothing was read
    out = io.StringIO()                                 # the largest that fits chats
    assert main(["--model", "tinygpt", "--max-tokens", "1019", "--temperature", "0"],
                stdin=io.StringIO("hi\n"), stdout=out) == 0
    assert "tinygpt> " in out.getvalue() and "not sent" not in out.getvalue()


def test_unknown_commands_are_not_sent_and_a_double_slash_sends_one(monkeypatch):
    import tinygpt.chat

    sent = []
    real = tinygpt.chat.fit_history

    def fit_history(tokenizer, messages, budget):
        sent.append(messages[-1]["content"])
        return real(tokenizer, messages, budget)

    monkeypatch.setattr(tinygpt.chat, "fit_history", fit_history)
    text, replies = chat(io.StringIO("/exit\n/help\n//help\n/usr/bin is a path\n/Help-me\n"))
    assert sent == ["/help", "/usr/bin is a path"] and len(replies) == 2
    assert text.count("(no command ") == 2
    assert "(no command /exit; the commands are /help, /reset, /quit; start a line with // " \
           "to send a leading /)" in text
    assert "(/reset clears the conversation, /quit or Ctrl-D leaves, /help lists this" in text


def test_help_names_every_model_name_the_loader_takes_and_the_commands(capsys):
    from tinygpt.loading import NAMES

    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in NAMES:
        assert f" {name} (" in out, name
    assert "start a line with // to send a leading /" in out
