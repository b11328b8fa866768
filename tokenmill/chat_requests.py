"""Generic chat requests (a task about a topic), the text tokenmill has its models answer when it
needs their own writing: training and measuring drafts (tokenmill.eval.prompts adds requests on
corpus passages), and ranking a vocabulary by what a model writes (engine/spec/shortlist.py).

    generic_request(rng, split)      one request's text: a task from TASKS about a topic of the split
    user_turns(tokenizer, contents)  each text as one user turn rendered by the model's chat template
"""

from __future__ import annotations

import random
from typing import Any

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
SPLITS = ("train", "eval")
"""Training requests name TOPICS, held-out ones EVAL_TOPICS."""


def generic_request(rng: random.Random, split: str = "train") -> str:
    """A task about a topic of ``split`` (TOPICS or EVAL_TOPICS), drawn from ``rng``."""
    task = rng.choice(TASKS)
    return task.format(topic=rng.choice(EVAL_TOPICS if split == "eval" else TOPICS))


def user_turns(tokenizer: Any, contents: list[str]) -> list[list[int]]:
    """Token ids of each text as one user turn, rendered by ``tokenizer``'s chat template for the
    assistant to answer (``tokenizer``: tokenmill's Tokenizer, or one with ``apply_chat_template``
    and ``encode``)."""
    out = []
    for content in contents:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        out.append(tokenizer.encode(rendered, add_special_tokens=False))
    return out
