"""``tokenmill bench`` end to end through the CLI against the fake server: serve, sweep, compare,
and one-line errors."""

from __future__ import annotations

import json

import pytest

from tests.benchmark.fake_server import Behaviour, FakeOpenAIServer
from tests.model_utils import save_byte_tokenizer
from tokenmill.cli import main


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-tok")
    save_byte_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer(Behaviour(ttft_s=0.02, gap_s=0.005, tokens_per_chunk=2)) as s:
        yield s


def common(server, tokenizer_dir, *extra) -> list[str]:
    return ["--base-url", server.url, "--tokenizer", tokenizer_dir, "--input-len", "8:16", "--output-len", "3", *extra]


def test_serve_prints_the_table_and_writes_json(server, tokenizer_dir, tmp_path, capsys) -> None:
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", *common(server, tokenizer_dir), "--num-requests", "6", "--max-concurrency", "2",
               "--slo", "ttft=2000,e2el=5000", "--warmup", "1", "--out", str(out), "--save-records"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "Serving Benchmark Result" in printed and "Request goodput (req/s)" in printed and str(out) in printed
    data = json.loads(out.read_text())
    assert data["kind"] == "serve" and data["client"]["model"] == "fake-model"  # found through /v1/models
    s = data["summary"]
    assert s["completed"] == 6 and s["total_output_tokens"] == 18 and s["request_goodput"] > 0
    assert len(data["records"]) == 6 and all(8 <= r["prompt_len"] <= 16 for r in data["records"])
    assert data["load"]["request_rate"] == "inf" and data["workload"]["kind"] == "random"


def test_sweep_writes_json_plot_and_report_and_compare_reads_them(server, tokenizer_dir, tmp_path, capsys) -> None:
    out = tmp_path / "sweep.json"
    rc = main(["bench", "sweep", *common(server, tokenizer_dir), "--num-requests", "4", "--concurrencies", "1,2",
               "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and "| 1 |" in printed and "| 2 |" in printed
    data = json.loads(out.read_text())
    assert [p["load"] for p in data["points"]] == [1, 2]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "![sweep](sweep.png)" in out.with_suffix(".md").read_text()
    assert main(["bench", "compare", str(out), str(out)]) == 0
    assert "0 regression(s)" in capsys.readouterr().out
    worse = json.loads(out.read_text())
    for p in worse["points"]:
        p["summary"]["output_throughput"] /= 2
    (tmp_path / "worse.json").write_text(json.dumps(worse))
    assert main(["bench", "compare", str(out), str(tmp_path / "worse.json"), "--fail-on-regression"]) == 1
    assert "REGRESSION" in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["sweep", "--rates", "1", "--concurrencies", "2"], "exactly one of --rates or --concurrencies"),
    (["serve", "--slo", "speed=3"], "bad SLO"),
    (["serve", "--duration", "1"], "finite request rate or a max concurrency"),
    (["serve", "--extra-body", "{oops"], "--extra-body is not JSON"),
])
def test_user_errors_are_one_line(server, tokenizer_dir, capsys, args, needle) -> None:
    rc = main(["bench", args[0], *common(server, tokenizer_dir), "--served-model-name", "m", *args[1:]])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


def test_unreachable_server_is_a_clear_error(tokenizer_dir, capsys) -> None:
    with FakeOpenAIServer() as dead:
        url = dead.url
    rc = main(["bench", "serve", "--base-url", url, "--tokenizer", tokenizer_dir, "--num-requests", "1"])
    assert rc == 2 and "cannot list the models" in capsys.readouterr().err


def test_compare_of_a_missing_file(capsys) -> None:
    assert main(["bench", "compare", "nope-a.json", "nope-b.json"]) == 2
    assert "cannot read nope-a.json" in capsys.readouterr().err
