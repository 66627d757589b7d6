"""`python -m tinygpt chat`: talk to a model in the terminal, token by token.

    python -m tinygpt chat                      # SmolLM2-135M-Instruct (installed, offline)
    python -m tinygpt chat --model path/to/model.gguf --temperature 0

Each line you type is a user turn; the whole conversation goes through the model's chat
template (tinygpt.gguf_tokenizer.GGUFTokenizer.encode_chat for a GGUF model) and the reply
streams as it is generated, up to the model's end-of-turn token. `/reset` forgets the
conversation, `/quit` (or end of input, Ctrl-D) leaves, `/help` lists the commands. Any other
line that is a single /word is no message either: it gets a note listing the commands; a line
starting with `//` is sent with one slash less (`//help` sends "/help"). When the conversation
outgrows the context, the oldest turns are dropped, with a note. A --max-tokens that leaves
the chat template (and --system) no room is refused at the start.

Ctrl-C during a reply stops it and returns to the prompt: the part written stays in the
conversation, as it stays on the screen, so the next turn follows what was read (a reply
stopped before its first token is dropped with its question). Ctrl-C anywhere else leaves
at once, without a traceback, with the exit status 130 of a program that SIGINT ended (128
+ 2), so a script can tell it from /quit's 0.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

COMMANDS = ("/help", "/reset", "/quit")
COMMANDS_HELP = ("/reset clears the conversation, /quit or Ctrl-D leaves, /help lists this, "
                 "Ctrl-C stops a reply; start a line with // to send a leading /")
COMMAND_LIKE = re.compile(r"/[A-Za-z][\w-]*")     # a line that is a single /word
INTERRUPTED = 130          # the exit status of a program that SIGINT ended: 128 + 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tinygpt chat",
                                     description="An interactive chat in the terminal.",
                                     epilog=f"In the chat: {COMMANDS_HELP}.")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (default: the installed SmolLM2-135M-Instruct), tinygpt "
                             "(the shipped checkpoint), tinygpt-moe (day 20's mixture of "
                             "experts), a .gguf file, a TinyGPT checkpoint folder or a Hugging "
                             "Face folder (Llama, Mistral, Qwen3-MoE, Mixtral, DeepSeek-V3)")
    parser.add_argument("--system", default=None, help="a system message opening the chat")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="longest reply in tokens (default 256)")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="0 = greedy (default 0.7)")
    parser.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling (0.9)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible replies")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads: 1 to 4 per usable core (default: torch's)")
    parser.add_argument("--stats", action="store_true",
                        help="after each reply, print its tokens, the time to its first token "
                             "and the tokens per second after it")
    return parser


def reply_stats(stamps: list[float]) -> str:
    """`--stats`' line for a reply: stamps[0] when it was asked for, then one per token."""
    n = len(stamps) - 1
    line = f"({n} tokens"
    if n:
        line += f", first after {stamps[1] - stamps[0]:.2f} s"
    if n > 1:
        line += f", then {(n - 1) / (stamps[-1] - stamps[1]):.1f} tokens/s"
    return line + ")"


def fit_history(tokenizer, messages: list[dict], budget: int) -> tuple[list[int], int]:
    """The prompt ids of `messages`, dropping the oldest non-system turns (in place) until it
    has at most `budget` ids. Returns (ids, turns dropped); ValueError when even the last
    message alone does not fit."""
    dropped = 0
    while True:
        ids = tokenizer.encode_chat(messages)
        if len(ids) <= budget:
            return ids, dropped
        first = 1 if messages[0]["role"] == "system" else 0
        if len(messages) - first <= 1:
            raise ValueError(f"the message is {len(ids)} tokens with the template; at most "
                             f"{budget} fit beside a reply of --max-tokens")
        del messages[first]
        dropped += 1


def main(argv: list[str] | None = None, stdin=None, stdout=None) -> int:
    """Run the chat loop over stdin / stdout. Returns 0 at /quit or end of input, 2 for bad
    arguments or a model that cannot be loaded, INTERRUPTED (130) for Ctrl-C outside a reply
    (one during a reply stops that reply only)."""
    stdout = sys.stdout if stdout is None else stdout
    try:
        return _chat(argv, stdin, stdout)
    except KeyboardInterrupt:
        print(file=stdout, flush=True)       # end the line the prompt or a reply left open
        return INTERRUPTED


def _chat(argv: list[str] | None, stdin, stdout) -> int:
    stdin = sys.stdin if stdin is None else stdin
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    import tinygpt

    if args.threads is not None:
        try:
            tinygpt.thread_count(args.threads, "--threads")
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    import torch

    from tinygpt.generate import stream
    from tinygpt.loading import load_model
    from tinygpt.sampling import SamplingParams, flag_message

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                max_new_tokens=args.max_tokens, seed=args.seed)
    except (TypeError, ValueError) as err:
        print(f"error: {flag_message(str(err), max_new_tokens='--max-tokens')}",
              file=sys.stderr)
        return 2
    try:
        model, tokenizer, info = load_model(args.model)
    except (OSError, ValueError) as err:
        print(f"error: cannot load the model: {err}", file=sys.stderr)
        return 2
    if args.max_tokens >= info.context_length:
        print(f"error: --max-tokens must be < the context of {info.context_length}",
              file=sys.stderr)
        return 2
    start = [] if args.system is None else [{"role": "system", "content": args.system}]
    try:                          # a base model: every message would be refused
        template = len(tokenizer.encode_chat(start + [{"role": "user", "content": "Hi"}]))
    except ValueError:
        print(f"error: {info.model_id}'s tokenizer has no chat template, so it cannot chat (a "
              f"base model continues text: serve it and use /v1/completions)", file=sys.stderr)
        return 2
    if template > info.context_length - args.max_tokens:     # every message would be refused
        opening = "the --system message and a" if start else "a"
        print(f"error: --max-tokens {args.max_tokens} leaves "
              f"{info.context_length - args.max_tokens} of the {info.context_length} context "
              f"positions for the conversation, but {opening} one-word message in the chat "
              f"template take {template}: --max-tokens must be at most "
              f"{max(info.context_length - template, 0)}", file=sys.stderr)
        return 2
    stops = set(info.end_of_turn_ids)
    messages = list(start)
    print(f"{info.model_id} ({sum(p.numel() for p in model.parameters()):,} parameters). "
          f"{COMMANDS_HELP}.", file=stdout, flush=True)
    interactive = stdin is sys.stdin and stdout is sys.stdout and stdin.isatty()
    while True:
        if interactive:                       # input(): line editing and history in a terminal
            try:
                line = input("\nyou> ") + "\n"
            except EOFError:
                line = ""
        else:
            print("\nyou> ", end="", file=stdout, flush=True)
            line = stdin.readline()
        if not line or line.strip() == "/quit":
            print(file=stdout, flush=True)
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            messages = list(start)
            print("(conversation cleared)", file=stdout, flush=True)
            continue
        if text.strip() == "/help":
            print(f"({COMMANDS_HELP})", file=stdout, flush=True)
            continue
        if COMMAND_LIKE.fullmatch(text.strip()):
            print(f"(no command {text.strip()}; the commands are {', '.join(COMMANDS)}; "
                  f"start a line with // to send a leading /)", file=stdout, flush=True)
            continue
        if text.startswith("//"):
            text = text[1:]
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            prompt, dropped = fit_history(tokenizer, messages,
                                          info.context_length - args.max_tokens)
        except ValueError as err:
            messages.pop()
            print(f"(not sent: {err})", file=stdout, flush=True)
            continue
        if dropped:
            print(f"(the {dropped} oldest turns no longer fit the context and were dropped)",
                  file=stdout, flush=True)
        print(f"{info.model_id}> ", end="", file=stdout, flush=True)
        reply, stamps = [], [time.perf_counter()]
        eos = info.end_of_turn_ids[0] if info.end_of_turn_ids else None
        events = stream(model, prompt, params, eos_id=eos, tokenizer=tokenizer)
        stopped = False
        try:
            for event in events:
                stamps.append(time.perf_counter())
                if event.token_id in stops:        # another end-of-turn id than the first
                    break
                reply.append(event.text)
                print(event.text, end="", file=stdout, flush=True)
        except KeyboardInterrupt:                  # Ctrl-C: this reply ends here
            stopped = True
        finally:
            events.close()
        print(file=stdout, flush=True)
        if stopped:
            kept = "the part written is kept" if reply else "the question is dropped"
            print(f"(reply stopped; {kept})", file=stdout, flush=True)
        if args.stats:
            print(reply_stats(stamps), file=stdout, flush=True)
        if stopped and not reply:
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    sys.exit(main())
