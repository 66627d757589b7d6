"""Bad input on the benchmark command lines: `python -m tinygpt bench`, `bench serve`,
`roofline` and `python -m tinygpt.bench.llamacpp`.

Each refusal is one `error: ...` line naming the option (exit 2; 1 for a server that cannot
be reached), and each comes before the slow work: the runner it would start (run_bench,
run_load, measure_local_roofline, llama-cpp-python's install check) is replaced by one that
fails the test when it is called. llama-cpp-python is not needed.
"""

from __future__ import annotations

import httpx
import pytest

from tinygpt import roofline
from tinygpt.bench import cli, llamacpp, load
from tinygpt.metrics import RequestTrace


def must_not_run(*args, **kwargs):
    raise AssertionError("the slow work started before the arguments were checked")


def refused(capsys, code: int, option: str) -> str:
    """The one error line of a refusal, checked to name `option`."""
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, captured
    assert err.startswith("error: ") and "\n" not in err and option in err, err
    return err


@pytest.fixture
def a_file(tmp_path):
    """A plain file: a path below it has a folder that cannot be made."""
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


def bad_outputs(tmp_path, a_file, option: str) -> list[tuple[list[str], str]]:
    """(argv, words the error must hold) for output paths refused before any run."""
    return [([option, ""], "empty"),
            ([option, str(tmp_path)], "is a folder"),
            ([option, str(a_file / "sub" / "out.svg")], "cannot write into the folder")]


def bad_plots(tmp_path) -> list[tuple[list[str], str]]:
    return [(["--plot", str(tmp_path / "p.txt")], ".png"),
            (["--plot", str(tmp_path / "no_extension")], ".svg")]


# ----------------------------------------------------------------------------------------------
# python -m tinygpt bench


def test_bench_output_paths_are_refused_before_the_run(monkeypatch, capsys, tmp_path, a_file):
    monkeypatch.setattr(cli, "run_bench", must_not_run)
    cases = [*bad_outputs(tmp_path, a_file, "--json"), *bad_outputs(tmp_path, a_file, "--plot"),
             *bad_plots(tmp_path)]
    for argv, words in cases:
        err = refused(capsys, cli.main(argv), argv[0])
        assert words in err, (argv, err)


def fake_run(seen: dict):
    def run(plan, **kwargs):
        seen.update(kwargs)
        return {"all_targets_met": True}, RequestTrace(0.0, (0.01, 0.02, 0.03), 4)
    return run


def test_bench_makes_the_output_folders_and_writes_there(monkeypatch, capsys, tmp_path):
    """As `make bench` writes into bench-results/, which need not exist yet."""
    monkeypatch.setattr(cli, "run_bench", fake_run({}))
    monkeypatch.setattr(cli, "format_table", lambda report: "the table")
    out_json, out_svg = tmp_path / "new" / "r.json", tmp_path / "other" / "t.svg"
    assert cli.main(["--json", str(out_json), "--plot", str(out_svg)]) == 0
    assert out_json.is_file() and out_svg.read_text().lstrip().startswith("<?xml")
    out = capsys.readouterr().out
    assert f"wrote {out_json}" in out and f"wrote {out_svg}" in out


def test_bench_plot_needs_the_requests_rows(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "run_bench", must_not_run)
    png = str(tmp_path / "t.png")
    err = refused(capsys, cli.main(["--plot", png, "--only", "kv_cache"]), "--plot")
    assert "--only requests" in err
    seen = {}
    monkeypatch.setattr(cli, "run_bench", fake_run(seen))
    monkeypatch.setattr(cli, "format_table", lambda report: "the table")
    assert cli.main(["--plot", png, "--only", "requests", "--only", "kv_cache"]) == 0
    assert seen["only"] == ["requests", "kv_cache"] and (tmp_path / "t.png").is_file()


def test_bench_list_checks_and_follows_only(capsys):
    err = refused(capsys, cli.main(["--list", "--only", "nosuch"]), "nosuch")
    assert "choose from ['requests', 'kv_cache'," in err       # requests was left out
    assert cli.main(["--list", "--only", "kv_cache"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == ["kv_cache"]


def test_bench_list_refuses_the_flags_of_a_run(capsys, tmp_path):
    out = tmp_path / "r.json"
    err = refused(capsys, cli.main(["--list", "--json", str(out), "--quick"]), "--list")
    assert "--quick, --json would do nothing" in err and not out.exists()


@pytest.mark.parametrize("argv,option", [
    (["--seed", "-5"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--ttft-slo", "inf"], "--ttft-slo"),
    (["--tpot-slo", "inf"], "--tpot-slo"),
    (["--threads", "100000"], "--threads"),
])
def test_bench_numbers_are_checked_before_the_run(monkeypatch, capsys, argv, option):
    monkeypatch.setattr(cli, "run_bench", must_not_run)
    refused(capsys, cli.main(argv), option)


# ----------------------------------------------------------------------------------------------
# python -m tinygpt bench serve


@pytest.mark.parametrize("argv,option", [
    (["--url", "notaurl"], "--url"),
    (["--url", ""], "--url"),
    (["--url", "ftp://x"], "--url"),
    (["--url", "http://"], "--url"),
    (["--url", "http://127.0.0.1:port"], "--url"),
    (["--url", "http://x", "--ttft-slo", "0"], "--ttft-slo"),
    (["--url", "http://x", "--tpot-slo", "-1"], "--tpot-slo"),
    (["--url", "http://x", "--tpot-slo", "inf"], "--tpot-slo"),
    (["--url", "http://x", "--requests", "0"], "--requests"),
    (["--url", "http://x", "--requests", "100001"], "--requests"),
    (["--url", "http://x", "--requests", "100000000000"], "--requests"),
    (["--url", "http://[::1"], "--url"),
    (["--url", "http://[nothost]:80"], "--url"),
    (["--url", "http://x", "--rates", "x"], "--rates"),
    (["--url", "http://x", "--rates", "1,,2"], "--rates"),
    (["--url", "http://x", "--rates", "inf"], "--rates"),
    (["--url", "http://x", "--rates", "0"], "--rates"),
    (["--url", "http://x", "--seed", "-5"], "--seed"),
    (["--url", "http://x", "--seed", str(2**32)], "--seed"),
])
def test_serve_load_arguments_are_checked_before_any_request(monkeypatch, capsys, argv, option):
    monkeypatch.setattr(load, "run_load", must_not_run)
    refused(capsys, cli.main(["serve", *argv]), option)


@pytest.mark.parametrize("rates, requests", [("1e-9", "1"), ("1,0.001", "100"),
                                             ("1", "100000")])
def test_serve_load_refuses_arrivals_expected_to_take_over_a_day(monkeypatch, capsys, rates,
                                                                 requests):
    monkeypatch.setattr(load, "run_load", must_not_run)
    err = refused(capsys, load.main(["--url", "http://x", "--rates", rates,
                                     "--requests", requests]), "--rates")
    assert f"--requests {requests} at --rates {rates} would take about " in err
    assert "at most 24: lower --requests or raise --rates" in err


def test_serve_load_takes_arrivals_of_up_to_a_day(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(load, "run_load",
                        lambda url, rate, n, **_: seen.append((rate, n)) or {"failed": 0})
    monkeypatch.setattr(load, "format_reports", lambda reports: "")
    assert load.main(["--url", "http://x", "--rates", "1,2", "--requests", "57600"]) == 0
    assert seen == [(1.0, 57600), (2.0, 57600)]     # 16 h + 8 h of arrivals


def test_serve_load_output_paths_are_checked_before_any_request(monkeypatch, capsys, tmp_path,
                                                               a_file):
    monkeypatch.setattr(load, "run_load", must_not_run)
    cases = [*bad_outputs(tmp_path, a_file, "--json"), *bad_outputs(tmp_path, a_file, "--plot"),
             *bad_plots(tmp_path)]
    for argv, words in cases:
        err = refused(capsys, load.main(["--url", "http://127.0.0.1:8000", *argv]), argv[0])
        assert words in err, (argv, err)


def test_serve_load_reports_a_server_it_cannot_reach_in_one_line(capsys):
    url = f"http://127.0.0.1:{load.free_port()}"          # nothing listens there
    assert load.main(["--url", url, "--rates", "1", "--requests", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: cannot reach {url}") and "Traceback" not in err[0]


def test_serve_load_reports_a_server_that_is_not_tinygpt_in_one_line(monkeypatch, capsys):
    def answer_404(url, *args, **kwargs):
        request = httpx.Request("GET", f"{url}/v1/models")
        raise httpx.HTTPStatusError("404", request=request,
                                    response=httpx.Response(404, request=request))

    monkeypatch.setattr(load, "run_load", answer_404)
    assert load.main(["--url", "http://127.0.0.1:8000", "--rates", "1"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: http://127.0.0.1:8000 answered GET /v1/models with HTTP 404")


# ----------------------------------------------------------------------------------------------
# python -m tinygpt roofline


def test_roofline_plot_paths_are_refused_before_measuring(monkeypatch, capsys, tmp_path, a_file):
    monkeypatch.setattr(roofline, "measure_local_roofline", must_not_run)
    for argv, words in [*bad_outputs(tmp_path, a_file, "--plot"), *bad_plots(tmp_path)]:
        err = refused(capsys, roofline.main(["--hardware", "local", *argv]), "--plot")
        assert words in err, (argv, err)


def test_roofline_writes_the_plot_it_names(capsys, tmp_path):
    out = tmp_path / "new" / "roof.pdf"
    assert roofline.main(["--hardware", "l4", "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(b"%PDF") and f"wrote {out}" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# python -m tinygpt.bench.llamacpp


@pytest.mark.parametrize("argv,option", [
    (["--tokens", "0"], "--tokens"),
    (["--rounds", "0"], "--rounds"),
    (["--threads", "0"], "--threads"),
    (["--threads", "-1"], "--threads"),
    (["--threads", "100000"], "--threads"),
    (["--formats", "BOGUS"], "F32,F16,Q8_0,Q4_1"),
    (["--formats", ""], "--formats"),
    (["--formats", "Q4_0"], "--formats"),
    (["--formats", "F32,F32"], "--formats"),
    (["--engine-requests", "-1"], "--engine-requests"),
    (["--engine-tokens", "0"], "--engine-tokens"),
    (["--long-prompts", "-1"], "--long-prompts"),
    (["--long-requests", "x"], "--long-requests"),
    (["--long-requests", "4,0"], "--long-requests"),
    (["--long-context", "-1"], "--long-context"),
    (["--long-context", "2000"], "--long-context"),
    (["--long-context", "0", "--tokens", "2040"], "--tokens"),
    (["--long-prompts", "2000"], "--long-prompts"),
    (["--engine-tokens", "2040"], "--engine-tokens"),
])
def test_llamacpp_arguments_are_checked_before_the_install_check(monkeypatch, capsys, argv,
                                                                 option):
    monkeypatch.setattr(llamacpp, "unavailable", must_not_run)
    refused(capsys, llamacpp.main(argv), option)


def test_llamacpp_good_arguments_reach_the_install_check(monkeypatch, capsys):
    monkeypatch.setattr(llamacpp, "unavailable", lambda: "llama_cpp is a stub here")
    assert llamacpp.main(["--long-context", "0", "--tokens", "2039"]) == 2
    assert "llama_cpp is a stub here" in capsys.readouterr().err
    assert llamacpp.main(["--formats", "Q8_0,Q4_1"]) == 2
    err = capsys.readouterr().err
    assert "without F32 in --formats none of them runs" in err and "stub" in err
    assert llamacpp.parse_formats("Q4_1,F32") == ["Q4_1", "F32"]
    assert llamacpp.parse_long_requests("4,16") == [4, 16]
