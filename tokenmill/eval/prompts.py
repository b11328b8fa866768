"""Chat prompts for training and measuring on a model's own answers (speculative heads, draft models).

    chat_prompts(tokenizer, n, seed)                 training prompts: half tasks on a passage of the
                                                     corpus' training half (summarise, continue,
                                                     explain, rewrite, question), half generic
                                                     requests (task x topic)
    chat_prompts(tokenizer, n, seed, split="eval")   held out: generic requests on topics the
                                                     training prompts never name (EVAL_TOPICS)

Each prompt is one user turn rendered by the model's chat template, ready for the assistant to answer.
"""

from __future__ import annotations

import random
from typing import Any

from tokenmill.errors import InvalidParameterError
from tokenmill.eval.corpus import fetch_corpus

TRAIN_SPLIT = (0.25, 0.75)
"""The corpus characters training prompts cut passages from (the middle half: perplexity reads
the start, calibration the end)."""

TOPICS = ["the water cycle", "how a bicycle works", "photosynthesis", "the French Revolution", "black holes",
          "compound interest", "how vaccines work", "the history of the printing press", "machine learning",
          "volcanoes", "the rules of chess", "healthy sleep habits", "how to bake bread", "the moon landing",
          "electric cars", "the immune system", "ancient Rome", "climate change", "how the internet works",
          "learning a new language", "the stock market", "honey bees", "the Pythagorean theorem", "recycling",
          "jazz music", "time management", "the human heart", "earthquakes", "renewable energy", "coffee",
          "the Renaissance", "dinosaurs", "how a refrigerator works", "the water supply of a city",
          "gardening", "the history of money", "coral reefs", "how rockets reach orbit",
          "the Industrial Revolution", "public speaking", "the periodic table", "how credit cards work",
          "ancient Egypt", "deserts", "the human skeleton", "first aid", "how search engines work",
          "the Silk Road", "wolves", "probability", "how glass is made", "the American Civil War",
          "meditation", "hurricanes", "how elections work", "the history of medicine", "octopuses",
          "saving for retirement", "how a camera works", "the Ice Age", "personal budgeting",
          "the printing of newspapers", "how wind turbines work", "nutrition labels", "the speed of light",
          "how to write a resume", "mushrooms", "prime numbers", "cloud computing", "how cheese is made",
          "sign language", "the theory of evolution", "penguins", "how to train a puppy",
          "the ancient Greeks", "nuclear power", "the history of video games", "how a car engine works",
          "urban planning", "the Cold War", "plate tectonics", "origami", "how soap works", "the Arctic",
          "the history of the telephone", "databases", "how to negotiate a salary", "the Vikings",
          "cryptography", "elephants", "how paper is made", "the Mayan civilization", "tornadoes",
          "writing a novel", "robots", "the history of the bicycle", "the human eye", "composting",
          "the invention of the telescope", "how a thermostat works", "the Aztecs", "sharks",
          "the history of photography", "board games", "how antibiotics work", "the Sahara"]
EVAL_TOPICS = ["the solar system", "how airplanes fly", "the Roman alphabet", "ocean tides", "public libraries",
               "the Olympic games", "rainforests", "how batteries work", "the Great Wall of China", "tea",
               "the human brain", "bridges", "migratory birds", "the metric system", "snowflakes", "chocolate"]
"""Topics of the held-out prompts: none of them is in TOPICS, and no training topic is the same
subject under other words (no tides, aviation, rainforests or the Mongols); neighbouring subjects
remain (telescopes and rockets beside the solar system, the eye beside the brain)."""
TASKS = ["Explain {topic} to a curious twelve-year-old.", "Write a short poem about {topic}.",
         "Give five practical tips related to {topic}.", "Write a short story that involves {topic}.",
         "What are the most common misconceptions about {topic}?", "Summarise the key facts about {topic}.",
         "Write a Python function related to {topic}, with a docstring and an example.",
         "Compare {topic} with something similar and list the differences.",
         "Write an email to a friend recommending they learn about {topic}."]
"""Generic chat requests (task x topic)."""
INSTRUCTIONS = [
    "Summarise the following passage in a few sentences.\n\n{passage}",
    "Continue this passage in the same style.\n\n{passage}",
    "Explain in plain modern English what happens in this passage.\n\n{passage}",
    "Rewrite the following passage as a short modern story.\n\n{passage}",
    "Who speaks in this passage, and what do they want?\n\n{passage}",
    "{passage}",
]
"""Tasks on a corpus passage."""
SPLITS = ("train", "eval")


def chat_prompts(tokenizer: Any, n: int, seed: int, split: str = "train", passage_chars: int = 1200) -> list[list[int]]:
    """``n`` prompts (token ids, seeded) of ``split``; see the module docstring. ``tokenizer``:
    one with ``apply_chat_template`` and ``encode`` (tokenmill's Tokenizer)."""
    if split not in SPLITS:
        raise InvalidParameterError(f"chat prompts: split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(seed)
    text = None
    out = []
    for i in range(n):
        if split == "eval":
            content = rng.choice(TASKS).format(topic=rng.choice(EVAL_TOPICS))
        elif i % 2:
            content = rng.choice(TASKS).format(topic=rng.choice(TOPICS))
        else:
            if text is None:
                text = fetch_corpus().read_text(encoding="utf-8")
                begin, end = (int(f * len(text)) for f in TRAIN_SPLIT)
            at = rng.randrange(begin, end - passage_chars)
            passage = text[at:at + rng.randrange(max(1, passage_chars // 4), passage_chars + 1)]
            content = INSTRUCTIONS[(i // 2) % len(INSTRUCTIONS)].format(passage=passage)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out.append(tokenizer.encode(rendered, add_special_tokens=False))
    return out
