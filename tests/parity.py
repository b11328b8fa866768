"""Parity helpers against HF transformers, after vLLM's ``check_logprobs_close``."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, top_n: int = 5, device: str = "cpu"):
    """Greedy continuation from an HF model (no EOS stop): (token ids, per-step top-n ids)."""
    past, ids, out, tops = None, torch.tensor([prompt_ids], device=device), [], []
    for _ in range(max_new_tokens):
        result = model(ids, past_key_values=past, use_cache=True)
        past = result.past_key_values
        logits = result.logits[0, -1].float()
        token = int(torch.argmax(logits))
        out.append(token)
        tops.append(torch.topk(logits, top_n).indices.tolist())
        ids = torch.tensor([[token]], device=device)
    return out, tops


def check_logprobs_close(ours: list[int], ours_top: list[list[int]], theirs: list[int],
                         theirs_top: list[list[int]]) -> bool:
    """True when the sequences are identical; at the first divergence each side's token must be
    in the other's top-n (a numerical near-tie), else AssertionError. Returns identical?"""
    for pos, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            assert a in theirs_top[pos] and b in ours_top[pos], (
                f"divergence at {pos}: ours {a} (HF top {theirs_top[pos]}), HF {b} (our top {ours_top[pos]})")
            return False
    return True


def count_identical_to_hf(llm, hf, prompt_ids: list[list[int]], max_tokens: int, device: str = "cpu") -> int:
    """Greedy ``max_tokens`` continuations from tokenmill (one batched generate) and HF; returns how
    many are identical, asserting every divergence is a top-5 near-tie (check_logprobs_close)."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    identical = 0
    for ids, out in zip(prompt_ids, llm.generate(prompt_ids, params)):
        sample = out.outputs[0]
        assert len(sample.token_ids) == max_tokens
        theirs, theirs_top = hf_greedy(hf, ids, max_tokens, device=device)
        identical += check_logprobs_close(sample.token_ids, [[t for t, _ in lp.top] for lp in sample.logprobs],
                                          theirs, theirs_top)
    return identical
