"""The real shipped models (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) loaded by tokenmill and by
HF transformers from the same GGUF: prompt logits within 2e-3 (float32), and 32-token greedy
continuations identical on at least 9 of 10 prompts, with any divergence a top-5 near-tie."""

from __future__ import annotations

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tokenmill import LLM  # noqa: E402
from tests.model_utils import prompt_logits  # noqa: E402
from tests.parity import count_identical_to_hf  # noqa: E402

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 17 * 23?\nA:",
    "The three primary colors are",
    "Translate to French: 'Good morning, how are you?'\n",
    "import numpy as np\nx = np.linspace(0, 1, 10)\n",
    "Photosynthesis is the process by which",
    "1, 1, 2, 3, 5, 8, 13,",
    "Dear hiring manager, I am writing to apply for",
]


def _models(path):
    ours = LLM(str(path), dtype="float32", device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return ours, hf


@pytest.fixture(scope="module", params=["smollm2_gguf", "gemma3_gguf"])
def pair(request):
    ours, hf = _models(request.getfixturevalue(request.param))
    yield ours, hf
    del ours, hf
    gc.collect()


def test_prompt_logits_match_hf(pair):
    ours, hf = pair
    model = ours.engine.runner.model
    worst = 0.0
    for text in PROMPTS:
        ids = ours.tokenizer.encode(text)
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].float()
        worst = max(worst, (prompt_logits(model, ids) - expected).abs().max().item())
    print(f"\n{ours.model_name}: max |logit diff| vs HF over {len(PROMPTS)} prompts = {worst:.2e}")
    assert worst <= 2e-3, worst


def test_greedy_continuations_match_hf(pair):
    ours, hf = pair
    prompt_ids = [ours.tokenizer.encode(t) for t in PROMPTS]
    identical = count_identical_to_hf(ours, hf, prompt_ids, 32)
    print(f"\n{ours.model_name}: {identical}/10 greedy continuations identical to HF")
    assert identical >= 9, f"only {identical}/10 continuations identical"
