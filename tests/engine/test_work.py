"""The per-step work model that cost attribution shares a step's time by (tokenmill/engine/work.py)."""

from __future__ import annotations

import random

import pytest

from tokenmill.config import ModelConfig
from tokenmill.engine.work import SequenceWork, WorkModel, matmul_params


def tiny_config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def brute_force(model: WorkModel, start: int, num_new: int, prompt_len: int, cached: int, rows: int) -> SequenceWork:
    """Every new token and every (query, key) pair, one at a time, charged by the rules of work.py."""
    work = SequenceWork("r")
    for q in range(start, start + num_new):
        setattr(work, "prompt" if q < prompt_len else "completion",
                getattr(work, "prompt" if q < prompt_len else "completion") + model.token_flops)
        for k in range(q + 1):
            kind = "cached" if k < cached else "prompt" if k < prompt_len else "completion"
            setattr(work, kind, getattr(work, kind) + model.pair_flops)
    work.completion += rows * model.logit_flops
    return work


@pytest.mark.parametrize("seed", range(40))
def test_closed_forms_match_counting_every_pair(seed):
    rng = random.Random(seed)
    model = WorkModel(token_flops=rng.randint(1, 1000), logit_flops=rng.randint(1, 1000), pair_flops=rng.randint(1, 50))
    prompt_len = rng.randint(1, 40)
    cached = rng.choice([0, rng.randint(0, prompt_len)])
    start = rng.randint(0, prompt_len + 10)
    num_new, rows = rng.randint(1, 20), rng.randint(0, 3)
    got = SequenceWork("r")
    model.sequence(got, start, num_new, prompt_len, cached, rows)
    want = brute_force(model, start, num_new, prompt_len, cached, rows)
    assert (got.prompt, got.cached, got.completion) == (want.prompt, want.cached, want.completion)


def test_a_cached_prompt_costs_its_reads_not_its_matmuls():
    model = WorkModel.of(tiny_config())
    cold, warm = SequenceWork("cold"), SequenceWork("warm")
    model.sequence(cold, 0, 64, 64, 0, 1)  # the whole prompt computed
    model.sequence(warm, 48, 16, 64, 48, 1)  # 48 tokens from the prefix cache, 16 computed
    assert cold.cached == 0 and warm.cached > 0
    assert warm.total < cold.total / 2
    assert warm.cached < cold.prompt  # reading cached K/V is far cheaper than computing those tokens


def test_matmul_params_counts_the_lm_head_once():
    cfg = tiny_config()
    assert matmul_params(cfg) - matmul_params(cfg, lm_head=False) == cfg.vocab_size * cfg.hidden_size
