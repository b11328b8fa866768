"""Self-speculation over a shortlist (engine/spec/shortlist.py): the model's own layers and a head of
the tokens it writes most. Its guesses are the target's greedy tokens wherever those are listed, and
the output is token for token what speculation off gives."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_speculative import MIXED
from tests.server.conftest import build_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine import SpeculativeConfig
from tokenmill.engine.spec import shortlist as sl
from tokenmill.errors import InvalidParameterError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-shortlist")
    build_tiny_checkpoint(path)
    return path


def test_tokens_rank_stop_tokens_first_then_by_score_then_by_id():
    scores = torch.zeros(9)
    scores[[5, 3, 7, 8]] = torch.tensor([2.5, 2.0, 0.5, 0.1])
    ranking = sl.rank_tokens(scores, always=[8])
    assert ranking.tolist() == [8, 5, 3, 7, 0, 1, 2, 4, 6]
    assert sl.shortlist(ranking, 4).tolist() == [3, 5, 7, 8]  # the first 4, in id order
    assert sl.shortlist(ranking, 50).tolist() == list(range(9))  # more than there are: all
    with pytest.raises(InvalidParameterError, match="draft_vocab_size must be >= 1, got 0"):
        sl.shortlist(ranking, 0)
    with pytest.raises(InvalidParameterError, match="draft_vocab_size must be >= 1, got 0"):
        SpeculativeConfig(speculative_method="shortlist", draft_vocab_size=0)


def test_the_shortlist_head_gives_the_listed_rows_logits(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu")
    model = llm.engine.runner.model
    vocab = torch.tensor([1, 4, 9, 100, 256])
    draft = sl.shortlist_model(model, vocab)
    assert draft.layers[0] is model.layers[0] and len(draft.layers) == len(model.layers)  # shared, not copied
    hidden = torch.randn(3, model.config.hidden_size)
    full, cut = model.compute_logits(hidden), draft.compute_logits(hidden)
    assert cut.shape == (3, len(vocab))
    torch.testing.assert_close(cut, full[:, vocab])


def test_greedy_answers_are_the_models_greedy_output(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu")
    prompts = [[(5 * i + j) % 250 for j in range(3 + 7 * i)] for i in range(4)]
    expected = [o.outputs[0].token_ids for o in
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))]
    got = sl.greedy_answers(llm.engine.runner.model, prompts, 12, frozenset(llm.tokenizer.stop_token_ids))
    assert got == expected


def test_the_ranking_is_computed_once_and_read_back(tiny_dir, tmp_path, monkeypatch):
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu")
    model, tokenizer = llm.engine.runner.model, llm.tokenizer
    first = sl.model_ranking(model, tokenizer, tmp_path)
    assert sorted(first.tolist()) == list(range(model.config.vocab_size))
    assert set(first[:len(tokenizer.stop_token_ids)].tolist()) == set(tokenizer.stop_token_ids)
    (saved,) = (tmp_path / "shortlists").iterdir()
    monkeypatch.setattr(sl, "greedy_answers", lambda *a, **k: pytest.fail("ranked again"))
    assert torch.equal(sl.model_ranking(model, tokenizer, tmp_path), first)
    saved.write_text("[1, 2")  # damaged: ranked again, with a warning
    monkeypatch.undo()
    assert torch.equal(sl.model_ranking(model, tokenizer, tmp_path), first)


def test_shortlist_drafts_give_the_output_of_speculation_off(tiny_dir, tmp_path, monkeypatch):
    """Greedy and seeded sampling through the shortlist draft: token for token what speculation off
    gives; guesses off the list are refused, and every block comes back."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prompts = [[(7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(8)]
    params = [MIXED[i % len(MIXED)] for i in range(len(prompts))]
    plain = LLM(str(tiny_dir), dtype="float32", device="cpu")
    spec = LLM(str(tiny_dir), dtype="float32", device="cpu",
               speculative={"method": "shortlist", "draft_vocab_size": 40, "num_speculative_tokens": 3,
                            "adaptive": False})
    runner, reused = spec.engine.runner, []
    execute = runner.execute

    def spy(inputs, with_hidden=False):  # verification reuses the draft's hidden states: one new token
        reused.extend(len(i.token_ids) == 1 and len(i.hidden_before) + 1 == i.num_sample_rows
                      for i in inputs if i.hidden_before is not None)
        return execute(inputs, with_hidden)

    monkeypatch.setattr(runner, "execute", spy)
    expected, got = plain.generate(prompts, params), spec.generate(prompts, params)
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)  # the listed tokens' argmax alone
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    c = spec.engine.drafter.counters
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens  # an eighth of the vocabulary listed: some guesses wrong
    assert reused and all(reused)
    proposer = spec.engine.drafter.proposer
    assert proposer.name == "shortlist(40)" and len(proposer.vocab) == 40
    # the tiny model repeats its prompt's last token: ending on a listed one, every guess is kept
    before = (c.num_draft_tokens, c.num_accepted_tokens)
    listed = int(proposer.vocab[7])
    assert spec.generate([[3, 1, 4, listed]], greedy)[0].outputs[0].token_ids == [listed] * 30
    assert c.num_draft_tokens - before[0] == c.num_accepted_tokens - before[1] > 20
    assert spec.engine.num_used_blocks == 0 and spec.engine.drafter.proposer.num_used_blocks == 0


def test_verification_takes_the_heads_kernel_of_a_plain_step(tiny_dir, tmp_path, monkeypatch):
    """The shortlist's verification rows ran the layers one row per sequence (the draft's passes, then
    the step): the runner asks the head for its kernel as for one row per sampling sequence
    (kernel_rows), so a quantized head whose kernel depends on the row count gives them plain
    decoding's bits (Gemma 3 as stored, batch 4: 12 of 12 greedy outputs identical, 5 without)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = LLM(str(tiny_dir), dtype="float32", device="cpu",
               speculative={"method": "shortlist", "draft_vocab_size": 40, "num_speculative_tokens": 3,
                            "adaptive": False})
    model, seen = spec.engine.runner.model, []
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden, kernel_rows=None:
                        seen.append((hidden.shape[0], kernel_rows)) or real(hidden, kernel_rows))
    spec.generate([[3, 1, 4, 9] * 3, [5, 9, 2] * 4], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    verifying = [(rows, k) for rows, k in seen if rows > 2]
    assert verifying and all(k == 2 for _, k in verifying)
