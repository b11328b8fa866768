"""Parity helpers against HF transformers, after vLLM's ``check_logprobs_close``."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, top_n: int = 5, device: str = "cpu"):
    """Greedy continuations of every prompt from an HF model (no EOS stop), in one left-padded batch
    with its attention mask and position ids, as ``generate`` batches: [(token ids, per-step top-n
    ids)] per prompt. One batch streams the weights once per step instead of once per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    past, out, tops = None, [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(max_new_tokens):
        result = model(ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True)
        past = result.past_key_values
        logits = result.logits[:, -1].float()
        tokens, top = logits.argmax(-1), logits.topk(top_n, dim=-1).indices
        for row in range(len(prompts)):
            out[row].append(int(tokens[row]))
            tops[row].append(top[row].tolist())
        ids = tokens[:, None]
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
        positions = positions[:, -1:] + 1
    return list(zip(out, tops))


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
    """Greedy ``max_tokens`` continuations from tokenmill and HF (one batch each); returns how
    many are identical, asserting every divergence is a top-5 near-tie (check_logprobs_close)."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    identical = 0
    for out, (theirs, theirs_top) in zip(llm.generate(prompt_ids, params),
                                         hf_greedy(hf, prompt_ids, max_tokens, device=device)):
        sample = out.outputs[0]
        assert len(sample.token_ids) == max_tokens
        identical += check_logprobs_close(sample.token_ids, [[t for t, _ in lp.top] for lp in sample.logprobs],
                                          theirs, theirs_top)
    return identical
