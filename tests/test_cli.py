"""The ``tokenmill`` command line, run as a user runs it (a subprocess): generation and chat print
text and exit 0; every user error is one ``error:`` line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tokenmill(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)


@pytest.mark.real_model
def test_generate_prints_the_completion() -> None:
    result = tokenmill("generate", "--max-tokens", "8", "The capital of France is")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.real_model
def test_generate_chat_answers_through_the_template() -> None:
    result = tokenmill("generate", "--chat", "--max-tokens", "16", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "<|im_start|>" not in result.stdout and "assistant" not in result.stdout


@pytest.mark.real_model
def test_chat_reads_turns_from_stdin_until_eof() -> None:
    result = tokenmill("chat", "--max-tokens", "16", stdin="What is the capital of France?\nAnd of Germany?\n")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    replies = [line[2:] for line in result.stdout.splitlines() if line.startswith("> ") and line[2:].strip()]
    assert len(replies) == 2, result.stdout
    assert "Paris" in replies[0]
    assert "Berlin" in replies[1]  # the second turn sees the first: the history is kept


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad")
    truncated = folder / "truncated.gguf"
    with smollm2_gguf.open("rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    not_gguf = folder / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 this is a zip file, not a model")
    return {"truncated": truncated, "not_gguf": not_gguf, "missing": folder / "missing.gguf"}


USER_ERRORS = {
    "missing file": (["generate", "--model", "{missing}", "hi"], "not found"),
    "truncated file": (["generate", "--model", "{truncated}", "hi"], "truncated"),
    "not a GGUF": (["generate", "--model", "{not_gguf}", "hi"], "not a GGUF file"),
    "unknown model": (["chat", "--model", "no-such-model"], "'no-such-model' not found"),
    "temperature": (["generate", "--temperature", "-1", "hi"], "temperature"),
    "top_p": (["generate", "--top-p", "0", "hi"], "top_p"),
    "context window": (["generate", "--max-model-len", "16", "word " * 40], "context window is 16 tokens"),
}


@pytest.fixture(scope="module")
def user_error_runs(bad_files: dict[str, Path]) -> dict[str, subprocess.CompletedProcess]:
    """Every case's process, started together (each spends ~2 s importing; 2 cores run them side by side)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(args: list[str]) -> subprocess.CompletedProcess:
        return tokenmill(*(a.format(**bad_files) if a.startswith("{") else a for a in args))

    with ThreadPoolExecutor(len(USER_ERRORS)) as pool:
        futures = {name: pool.submit(run, args) for name, (args, _) in USER_ERRORS.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("case", USER_ERRORS)
def test_user_errors_are_one_line(case: str, user_error_runs: dict[str, subprocess.CompletedProcess]) -> None:
    result, needle = user_error_runs[case], USER_ERRORS[case][1]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert needle in lines[0]
