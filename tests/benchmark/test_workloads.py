"""Workloads: random prompts encode to exactly the drawn token counts (byte tokenizer; the real
SmolLM2 tokenizer under real_model), prefix sharing, multi-turn and JSONL files, all seeded."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from tests.model_utils import save_byte_tokenizer
from tokenmill.benchmark.workloads import (
    LengthDist,
    WorkloadSpec,
    build_workload,
    jsonl_workload,
    load_tokenizer,
    multi_turn_workload,
    prefix_workload,
    random_workload,
)
from tokenmill.errors import InvalidParameterError


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("byte-tok")
    save_byte_tokenizer(path)
    return load_tokenizer(path)


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def test_random_prompts_are_token_exact_with_the_byte_tokenizer(byte_tok) -> None:
    convs = random_workload(byte_tok, 60, LengthDist(1, 300), LengthDist(4, 9), seed=0)
    lens = [c.turns[0].prompt_len for c in convs]
    assert len(set(lens)) > 30 and min(lens) >= 1 and max(lens) <= 300
    for c in convs:
        assert n_tokens(byte_tok, c.turns[0].prompt) == c.turns[0].prompt_len
        assert 4 <= c.turns[0].output_len <= 9
        assert "<|endoftext|>" not in c.turns[0].prompt  # no special tokens drawn


@pytest.mark.real_model
def test_random_prompts_are_token_exact_with_smollm2() -> None:
    tok = load_tokenizer("smollm2-135m-instruct")
    convs = random_workload(tok, 40, LengthDist(1, 2048), LengthDist(16, 16), seed=5)
    assert all(n_tokens(tok, c.turns[0].prompt) == c.turns[0].prompt_len for c in convs)


def test_same_seed_same_workload(byte_tok) -> None:
    spec = WorkloadSpec("random", 10, "5:50", "3:7", seed=11)
    assert build_workload(spec, byte_tok) == build_workload(spec, byte_tok)
    other = WorkloadSpec("random", 10, "5:50", "3:7", seed=12)
    assert build_workload(spec, byte_tok) != build_workload(other, byte_tok)


def test_prefix_workload_shares_each_system_prompt_among_its_questions(byte_tok) -> None:
    convs = prefix_workload(byte_tok, num_prefixes=3, num_questions=12, prefix_len=40, input_len=LengthDist(8, 8),
                            output_len=LengthDist(5, 5), seed=2)
    counts = Counter(c.system for c in convs)
    assert len(counts) == 3 and set(counts.values()) == {4}
    assert all(n_tokens(byte_tok, s) == 40 for s in counts)
    assert len({c.turns[0].prompt for c in convs}) == 12
    switches = sum(a.system != b.system for a, b in itertools.pairwise(convs))
    assert switches > 2  # interleaved, not grouped by prefix


def test_multi_turn_workload(byte_tok) -> None:
    convs = multi_turn_workload(byte_tok, 5, 4, LengthDist(10, 20), LengthDist(2, 2), seed=0)
    assert len(convs) == 5 and all(len(c.turns) == 4 for c in convs)
    assert all(n_tokens(byte_tok, t.prompt) == t.prompt_len for c in convs for t in c.turns)


def test_jsonl_workload(tmp_path, byte_tok) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello there", "output_len": 7}, {"prompt": "abc"},
             {"turns": ["first", "second"], "system": "be brief"}, {"prompt": "not taken"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    convs = jsonl_workload(path, byte_tok, LengthDist(3, 3), num_requests=3)
    assert [len(c.turns) for c in convs] == [1, 1, 2]
    assert convs[0].turns[0].prompt_len == 11 and convs[0].turns[0].output_len == 7
    assert convs[1].turns[0].output_len == 3
    assert convs[2].system == "be brief" and convs[2].system_len == 8
    assert [t.prompt for t in convs[2].turns] == ["first", "second"]


def test_jsonl_errors_name_the_line(tmp_path, byte_tok) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(InvalidParameterError, match="bad.jsonl:2"):
        jsonl_workload(path, byte_tok, LengthDist(3, 3))


@pytest.mark.parametrize("text, expected", [("7", LengthDist(7, 7)), ("3:9", LengthDist(3, 9)), (12, LengthDist(12, 12))])
def test_length_dist_parse(text, expected) -> None:
    assert LengthDist.parse(text) == expected


@pytest.mark.parametrize("text", ["0", "9:3", "a", "1:b", "-2"])
def test_length_dist_rejects(text) -> None:
    with pytest.raises(InvalidParameterError):
        LengthDist.parse(text)
