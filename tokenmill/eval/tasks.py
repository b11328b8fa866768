"""Short-answer tasks with checkable answers, for measuring and routing between models.

    items("add", 150, seed=0, split="eval")   150 held-out two-digit additions, as TaskItems
    item.messages                              one user turn: the question and a fixed "answer only" line
    item.check(model_text)                     whether the model's answer is the gold one

Every task is a finite universe of items, built in a fixed order (numbers in a range, a knowledge
list written below). The universe is cut once into a train and an eval part by a shuffle seeded with
the task's name alone, so the two parts are disjoint and stay the same whatever ``seed`` a caller
passes; ``seed`` only chooses which items of the part come back, and in which order. The
knowledge tasks (capitals, opposites, words) have a few dozen entries, so half of each goes to eval.

Checking. Small models rarely answer with the bare answer; they say "23 + 45 = 68", "The capital
of Japan is Tokyo." or "The first letter of 'banana' is 'B'." :func:`answer_tokens` splits the
answer into lower-case words and numbers (accents and punctuation dropped, "1,000" read as 1000)
and skips every token the question itself contains, and a few filler words ("the", "answer",
"is"), except the item's ``options``: the answers a question names itself ("which is larger, 37
or 73?"), which always count; a verbatim repeat of the whole question is dropped first, so that
echoing "Which is larger, 73 or 37?" does not pick 73. The first tokens left are the model's answer::

    question "What is 23 + 45?"             skipped: what is 23 45 (+ the, answer, ...)
    answer   "23 + 45 = 68."                tokens:  23 45 68  ->  answer 68
    answer   "The answer is 68"             tokens:  the answer is 68  ->  answer 68

The answer is right when those first tokens equal the gold answer's tokens (or an alias's). Items
are built so that the gold answer never shares a token with the question, except as an option.
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass, field
from functools import cache
from typing import Callable

from tokenmill.errors import InvalidParameterError

SPLITS = ("train", "eval")
FILLER = frozenset("""the a an answer answers is it its s of so that this final result correct my i think
    would be here sure to are equals equal you your we get gives called""".split())
"""Words skipped in an answer before the answer proper (unless the item names them as an option)."""
_TOKEN = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)|\d+(?:\.\d+)?|[^\W\d_]+")


@dataclass(frozen=True)
class TaskItem:
    """One question with a checkable short answer."""

    id: str
    """``"<task>/<key>"``, unique across tasks and stable across versions of the universe order."""
    task: str
    question: str
    """The question alone, e.g. "What is 23 + 45?"."""
    instruction: str
    """The fixed format line after the question, e.g. "Reply with the number only."."""
    gold: str
    """The answer, as a person would write it."""
    aliases: tuple[str, ...] = ()
    """Other spellings also counted right ("Kiev" for "Kyiv")."""
    options: tuple[str, ...] = ()
    """Answers the question itself names ("37", "73" in "which is larger, 37 or 73?"): never skipped."""

    @property
    def prompt(self) -> str:
        return f"{self.question} {self.instruction}"

    @property
    def messages(self) -> list[dict[str, str]]:
        """The chat: one user turn asking for the answer only."""
        return [{"role": "user", "content": self.prompt}]

    def check(self, text: str) -> bool:
        """Whether ``text`` answers with the gold answer (or an alias); see the module docstring."""
        said = [t.text for t in answer_tokens(self._without_echo(text), self._skipped())]
        return any(said[:len(want)] == want for want in map(tokens, (self.gold, *self.aliases)))

    def answer_span(self, text: str) -> tuple[int, int] | None:
        """Character span of ``text`` that :meth:`check` reads as the answer (None: nothing left)."""
        width = len(tokens(self.gold))
        said = answer_tokens(self._without_echo(text), self._skipped())[:width]
        return (said[0].start, said[-1].end) if said else None

    def _without_echo(self, text: str) -> str:
        """``text`` with every verbatim repeat of the question blanked out (offsets kept)."""
        return re.sub(re.escape(self.question), lambda m: " " * len(m.group()), text, flags=re.IGNORECASE)

    def _skipped(self) -> frozenset[str]:
        named = {t for option in (self.gold, *self.aliases, *self.options) for t in tokens(option)}
        return (frozenset(tokens(self.prompt)) | FILLER) - named


@dataclass(frozen=True)
class Token:
    """A word or number of an answer, normalised, with its character span in the original text."""

    text: str
    start: int
    end: int


def tokens(text: str) -> list[str]:
    """Lower-case words and numbers of ``text``, accents and punctuation dropped."""
    return [t.text for t in _scan(text)]


def answer_tokens(text: str, skipped: frozenset[str]) -> list[Token]:
    """The tokens of ``text`` that are not in ``skipped``, in order."""
    return [t for t in _scan(text) if t.text not in skipped]


def _scan(text: str) -> list[Token]:
    return [Token(_normalise(m.group()), m.start(), m.end()) for m in _TOKEN.finditer(text)]


def _normalise(token: str) -> str:
    if token[0].isdigit():
        number = token.replace(",", "")
        return number.rstrip("0").rstrip(".") if "." in number else number
    plain = unicodedata.normalize("NFKD", token.lower())
    return "".join(c for c in plain if not unicodedata.combining(c))


@dataclass(frozen=True)
class Task:
    """A named universe of items and how it splits into train and eval."""

    name: str
    description: str
    build: Callable[[], list[TaskItem]] = field(repr=False)
    """The whole universe, in a fixed order."""
    eval_fraction: float = 0.25

    def split(self, split: str) -> list[TaskItem]:
        """The items of ``split``: a fixed part of the universe (see the module docstring)."""
        if split not in SPLITS:
            raise InvalidParameterError(f"task split must be one of {SPLITS}, got {split!r}")
        universe = _universe(self.name)
        order = list(range(len(universe)))
        random.Random(f"split/{self.name}").shuffle(order)
        cut = round(len(order) * self.eval_fraction)
        chosen = sorted(order[:cut] if split == "eval" else order[cut:])
        return [universe[i] for i in chosen]


def items(task: str, n: int, seed: int, split: str = "train") -> list[TaskItem]:
    """``n`` distinct items of ``task``'s ``split``, chosen and ordered by ``seed``."""
    pool = get_task(task).split(split)
    if not 0 <= n <= len(pool):
        raise InvalidParameterError(f"task {task!r} has {len(pool)} {split} items, asked for {n}")
    return random.Random(seed).sample(pool, n)


def mixture(tasks: list[str], n: int, seed: int, split: str = "train") -> list[TaskItem]:
    """``n`` items of ``split``, ``n // len(tasks)`` from each of ``tasks`` (one more from each of the
    first ``n % len(tasks)``), shuffled together by ``seed``."""
    counts = [n // len(tasks) + (i < n % len(tasks)) for i in range(len(tasks))]
    out = [item for i, (task, k) in enumerate(zip(tasks, counts)) for item in items(task, k, seed + i, split)]
    random.Random(seed).shuffle(out)
    return out


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise InvalidParameterError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]


@cache
def _universe(name: str) -> tuple[TaskItem, ...]:
    return tuple(TASKS[name].build())


# --- generators --------------------------------------------------------------------------------

NUMBER = "Reply with the number only."


def _item(task: str, key: str, question: str, instruction: str, gold: object, **extra: tuple[str, ...]) -> TaskItem:
    return TaskItem(f"{task}/{key}", task, question, instruction, str(gold), **extra)


def _addition() -> list[TaskItem]:
    return [_item("add", f"{a}+{b}", f"What is {a} + {b}?", NUMBER, a + b)
            for a in range(10, 100) for b in range(10, 100)]


def _subtraction() -> list[TaskItem]:
    """a - b with a > b, both two-digit, and a result that is neither operand."""
    return [_item("sub", f"{a}-{b}", f"What is {a} - {b}?", NUMBER, a - b)
            for a in range(11, 100) for b in range(10, a) if a - b not in (a, b)]


def _multiplication() -> list[TaskItem]:
    """A one-digit number (2-9) times a number from 2 to 19."""
    return [_item("mul", f"{a}x{b}", f"What is {a} times {b}?", NUMBER, a * b)
            for a in range(2, 10) for b in range(2, 20)]


def _larger() -> list[TaskItem]:
    return [_item("larger", f"{a}-{b}", f"Which is larger, {a} or {b}?", NUMBER, max(a, b), options=(str(a), str(b)))
            for a in range(10, 100) for b in range(10, 100) if a != b]


def _successor() -> list[TaskItem]:
    return [_item("next", str(a), f"What number comes right after {a}?", NUMBER, a + 1) for a in range(10, 999)]


CONVERSIONS = [("hours", "minutes", 60), ("minutes", "seconds", 60), ("meters", "centimeters", 100),
               ("kilograms", "grams", 1000), ("kilometers", "meters", 1000), ("days", "hours", 24),
               ("weeks", "days", 7), ("feet", "inches", 12), ("dollars", "cents", 100), ("years", "months", 12)]


def _conversion() -> list[TaskItem]:
    return [_item("convert", f"{v}{big}-{small}", f"How many {small} are in {v} {big}?", NUMBER, v * factor)
            for big, small, factor in CONVERSIONS for v in range(2, 21)]


CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Greece": "Athens",
    "the United Kingdom": "London", "Ireland": "Dublin", "Austria": "Vienna", "Hungary": "Budapest",
    "Poland": "Warsaw", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "the Netherlands": "Amsterdam", "Belgium": "Brussels", "the Czech Republic": "Prague", "Turkey": "Ankara",
    "Iran": "Tehran", "Iraq": "Baghdad", "India": "New Delhi", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "South Korea": "Seoul", "Indonesia": "Jakarta", "the Philippines": "Manila", "Australia": "Canberra",
    "Canada": "Ottawa", "the United States": "Washington", "Argentina": "Buenos Aires", "Peru": "Lima",
    "Chile": "Santiago", "Colombia": "Bogota", "Venezuela": "Caracas", "Cuba": "Havana", "Kenya": "Nairobi",
    "Nigeria": "Abuja", "Ethiopia": "Addis Ababa", "Morocco": "Rabat", "Saudi Arabia": "Riyadh",
    "Pakistan": "Islamabad", "Ukraine": "Kyiv", "Switzerland": "Bern", "Romania": "Bucharest",
    "Bulgaria": "Sofia", "Serbia": "Belgrade", "Iceland": "Reykjavik", "Afghanistan": "Kabul", "Nepal": "Kathmandu",
    "Syria": "Damascus", "Lebanon": "Beirut", "Brazil": "Brasilia",
}
CAPITAL_ALIASES = {"New Delhi": ("Delhi",), "Kyiv": ("Kiev",), "Bern": ("Berne",)}


def _capital() -> list[TaskItem]:
    return [_item("capital", country.removeprefix("the ").replace(" ", "_"), f"What is the capital of {country}?",
                  "Reply with the city name only.", city, aliases=CAPITAL_ALIASES.get(city, ()))
            for country, city in CAPITALS.items()]


OPPOSITES = {
    "hot": ("cold",), "big": ("small", "little"), "up": ("down",), "fast": ("slow",), "happy": ("sad", "unhappy"),
    "tall": ("short",), "open": ("closed", "shut"), "wet": ("dry",), "early": ("late",), "full": ("empty",),
    "hard": ("soft", "easy"), "heavy": ("light",), "rich": ("poor",), "young": ("old",), "thick": ("thin",),
    "strong": ("weak",), "loud": ("quiet", "soft"), "clean": ("dirty",), "day": ("night",), "win": ("lose",),
    "push": ("pull",), "buy": ("sell",), "left": ("right",), "inside": ("outside",), "true": ("false",),
    "love": ("hate",), "begin": ("end", "finish"), "above": ("below", "beneath"), "friend": ("enemy", "foe"),
    "north": ("south",), "east": ("west",), "black": ("white",), "good": ("bad", "evil"), "first": ("last",),
    "awake": ("asleep",), "cheap": ("expensive",), "deep": ("shallow",), "always": ("never",),
    "question": ("answer",), "arrive": ("leave", "depart"),
}


def _opposite() -> list[TaskItem]:
    return [_item("opposite", word, f"What is the opposite of the word '{word}'?", "Reply with one word only.",
                  answers[0], aliases=answers[1:])
            for word, answers in OPPOSITES.items()]


WORDS = """apple banana cherry grape lemon mango orange peach melon river mountain forest island desert ocean
    garden window table chair pencil rocket planet guitar piano violin candle bottle basket blanket jacket
    tiger zebra rabbit monkey donkey turtle spider eagle parrot dolphin camel horse kitten puppy yellow purple
    silver winter summer spring morning castle bridge market school doctor farmer sailor""".split()


def _first_letter() -> list[TaskItem]:
    return [_item("first_letter", w, f"What is the first letter of the word '{w}'?", "Reply with the letter only.",
                  w[0]) for w in WORDS]


def _last_letter() -> list[TaskItem]:
    return [_item("last_letter", w, f"What is the last letter of the word '{w}'?", "Reply with the letter only.",
                  w[-1]) for w in WORDS]


def _reverse() -> list[TaskItem]:
    return [_item("reverse", w, f"What is the word '{w}' spelled backwards?", "Reply with the reversed word only.",
                  w[::-1]) for w in WORDS if w[::-1] != w]


TASKS: dict[str, Task] = {task.name: task for task in [
    Task("add", "two-digit addition", _addition),
    Task("sub", "two-digit subtraction, positive result", _subtraction),
    Task("mul", "one-digit times up to 19", _multiplication),
    Task("larger", "the larger of two two-digit numbers", _larger),
    Task("next", "the number after a number below 999", _successor),
    Task("convert", "unit conversions (hours to minutes, meters to centimeters, ...)", _conversion),
    Task("capital", "capital city of a country", _capital, eval_fraction=0.5),
    Task("opposite", "opposite of a common word", _opposite, eval_fraction=0.5),
    Task("first_letter", "first letter of a word", _first_letter, eval_fraction=0.5),
    Task("last_letter", "last letter of a word", _last_letter, eval_fraction=0.5),
    Task("reverse", "a word spelled backwards", _reverse, eval_fraction=0.5),
]}
"""Every task by name."""
