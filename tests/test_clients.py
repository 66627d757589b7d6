"""Real clients against `python -m tinygpt serve`: EleutherAI's lm-evaluation-harness
(`local-completions` with `tokenizer_backend=remote`, so it tokenizes through the server's
/tokenize and scores through logprobs with echo) on two small tasks defined here, with the
scores it gets from the same tasks run on the model in process; and guidellm's request shape.
Nothing is downloaded: the tasks read tests/data/lm_eval/*.jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tinygpt import load_pretrained
from tinygpt.bench.load import running_server
from tinygpt.generate import generate
from tinygpt.sampling import SamplingParams

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.model import TemplateLM  # noqa: E402 (after the skip)

DATA = Path(__file__).parent / "data" / "lm_eval"
TASKS = {
    "tinygpt_continue": """
task: tinygpt_continue
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/continue.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: [".", "\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "tinygpt_choice": """
task: tinygpt_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
""",
}


class InProcess(TemplateLM):
    """The shipped model scored in process: log-probabilities from the plain forward pass,
    greedy generation with tinygpt.generate, and the server's tokenization (special-token
    names read as their ids, as /tokenize does)."""

    def __init__(self) -> None:
        super().__init__()
        self.model, self.tokenizer = load_pretrained()
        self.model.eval()

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.special_tokens["<|endoftext|>"]

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, allowed_special="all")

    def _loglikelihood_tokens(self, requests, **kwargs):
        out = []
        for _, context, continuation in requests:
            ids = torch.tensor([context + continuation])
            with torch.inference_mode():
                logp = torch.log_softmax(self.model(ids[:, :-1])[0].float(), dim=-1)
            rows = logp[len(context) - 1:]
            target = torch.tensor(continuation)
            value = rows.gather(1, target[:, None]).sum().item()
            out.append((value, bool((rows.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, **kwargs):
        raise NotImplementedError("the test tasks need no rolling loglikelihood")

    def generate_until(self, requests, **kwargs):
        out = []
        for request in requests:
            context, options = request.args
            params = SamplingParams(temperature=0.0, max_new_tokens=options["max_gen_toks"],
                                    stop=tuple(options["until"]) + ("<|endoftext|>",))
            out.append(generate(self.model, self.tok_encode(context), params,
                                eos_id=self.eot_token_id, tokenizer=self.tokenizer).text)
        return out


def evaluate(model, folder: Path, **options) -> dict:
    from lm_eval.tasks import TaskManager

    folder.mkdir()
    for name, text in TASKS.items():
        (folder / f"{name}.yaml").write_text(text.format(data=DATA))
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=list(TASKS), task_manager=manager,
                                   log_samples=True, random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0, **options)


def per_sample(results: dict, task: str) -> list:
    return [sample["filtered_resps"] for sample in
            sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def served():
    """One server for both clients."""
    with running_server("--threads", "1", env=dict(os.environ, OMP_NUM_THREADS="1")) as (
            url, _):
        yield url


def test_lm_eval_harness_scores_equal_the_model_in_process(served, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    local = evaluate(InProcess(), tmp_path / "local")
    remote = evaluate("local-completions", tmp_path / "remote", model_args=(
        f"model=tinygpt,base_url={served}/v1/completions,tokenizer_backend=remote,"
        f"tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=1024"))
    for task, metric in (("tinygpt_continue", "exact_match,none"), ("tinygpt_choice",
                                                                    "acc,none")):
        assert remote["results"][task][metric] == local["results"][task][metric], task
    assert 0 < local["results"]["tinygpt_choice"]["acc,none"]
    assert per_sample(remote, "tinygpt_continue") == per_sample(local, "tinygpt_continue")
    for got, want in zip(per_sample(remote, "tinygpt_choice"),
                         per_sample(local, "tinygpt_choice"), strict=True):
        for (got_ll, got_greedy), (want_ll, want_greedy) in zip(got, want, strict=True):
            assert got_ll == pytest.approx(want_ll, abs=1e-4) and got_greedy == want_greedy


def test_a_guidellm_run_with_its_default_chat_requests_succeeds(served, tmp_path):
    """guidellm's default request format: streaming chat with text-part content,
    stream_options {include_usage, continuous_usage_stats}; four concurrent streams."""
    import subprocess
    import sys

    import httpx

    pytest.importorskip("guidellm")
    prompts = Path(__file__).parent / "data" / "guidellm_prompts.jsonl"
    count = len(prompts.read_text().splitlines())
    out = tmp_path / "guidellm.json"
    url = served
    before = httpx.get(f"{url}/metrics").text
    run = subprocess.run(
        [sys.executable, "-m", "guidellm", "run",
         "--backend", f"kind=openai_http,target={url},model=tinygpt,max_tokens=16",
         "--profile", "kind=concurrent,streams=4",
         "--constraint", f"kind=max_requests,count={count}",
         "--data", f"kind=json_file,path={prompts}",
         "--output", f"kind=json,path={out}", "--disable-console"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                 GUIDELLM__MAX_WORKER_PROCESSES="1"))   # one worker: starts faster
    metrics = httpx.get(f"{url}/metrics").text
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    assert report["request_totals"] == {"successful": count, "errored": 0, "incomplete": 0,
                                        "total": count}
    assert report["output_token_count"]["successful"]["total_sum"] > 0
    label = 'tinygpt_http_requests_total{path="/v1/chat/completions",status="200"} '

    def served_chats(text: str) -> float:
        line = [x for x in text.splitlines() if x.startswith(label)]
        return float(line[0].split()[-1]) if line else 0.0

    assert served_chats(metrics) - served_chats(before) == count
