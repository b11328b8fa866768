"""Short-answer tasks: seeded, train and eval apart, and a checker that reads the answer however it is phrased."""

from __future__ import annotations

import pytest

from tokenmill.errors import InvalidParameterError
from tokenmill.eval.tasks import TASKS, TaskItem, get_task, items, mixture, tokens


@pytest.mark.parametrize("task", list(TASKS))
def test_items_are_seeded_and_distinct(task):
    n = min(10, len(get_task(task).split("eval")))
    a, b = items(task, n, seed=3, split="eval"), items(task, n, seed=3, split="eval")
    assert a == b
    assert len({i.id for i in a}) == n
    assert [i.id for i in items(task, n, seed=4, split="eval")] != [i.id for i in a]


@pytest.mark.parametrize("task", list(TASKS))
def test_train_and_eval_are_disjoint_and_cover_the_universe(task):
    train, held_out = get_task(task).split("train"), get_task(task).split("eval")
    assert train and held_out
    assert not {i.id for i in train} & {i.id for i in held_out}
    assert not {i.question for i in train} & {i.question for i in held_out}
    assert len({i.id for i in train + held_out}) == len(train) + len(held_out)


def test_the_split_does_not_depend_on_the_seed():
    """Whatever seed a caller passes, an eval item is never a train item."""
    train = {i.id for i in get_task("add").split("train")}
    for seed in range(5):
        assert not {i.id for i in items("add", 200, seed, "eval")} & train


@pytest.mark.parametrize("task", list(TASKS))
def test_an_echo_of_the_question_is_never_right(task):
    """Gold answers share no token with their question (options aside), so a model that repeats
    the question is not credited with the answer."""
    for item in get_task(task).split("train") + get_task(task).split("eval"):
        if not item.options:
            assert not set(tokens(item.gold)) & set(tokens(item.question)), item.id
            assert not item.check(item.prompt)


@pytest.mark.parametrize("task", list(TASKS))
def test_every_item_accepts_its_gold_answer(task):
    for item in get_task(task).split("eval"):
        assert item.check(item.gold) and item.check(f"The answer is {item.gold}.") and item.check(f" {item.gold}\n")


def test_messages_are_one_user_turn_with_the_fixed_format():
    item = items("capital", 1, seed=0, split="eval")[0]
    assert item.messages == [{"role": "user", "content": f"{item.question} {item.instruction}"}]
    assert item.instruction.startswith("Reply with") and item.instruction.endswith("only.")


NUMBER = TaskItem("t/1", "t", "What is 40 + 2?", "Reply with the number only.", "42")


@pytest.mark.parametrize("text", ["42", "The answer is 42.", " 42\n", "40 + 2 = 42", "40 + 2 is 42.", "**42**",
                                  "42.0", "The answer is: 42!", "It's 42"])
def test_check_accepts_the_answer_in_varied_formats(text):
    assert NUMBER.check(text)


@pytest.mark.parametrize("text", ["43", "The answer is 24.", "40 + 2 = 44", "420", "4.2", "", "forty-two",
                                  "What is 40 + 2?", "I think 41, not 42"])
def test_check_rejects_wrong_answers(text):
    assert not NUMBER.check(text)


def test_words_compare_without_case_accents_or_punctuation():
    city = TaskItem("t/co", "t", "What is the capital of Colombia?", "Reply with the city name only.", "Bogota")
    assert city.check("Bogotá.") and city.check("The capital of Colombia is BOGOTA")
    assert not city.check("Medellin") and not city.check("The capital of Colombia is Cali, not Bogota.")
    two_words = TaskItem("t/ar", "t", "What is the capital of Argentina?", "", "Buenos Aires", aliases=("BA",))
    assert two_words.check("Buenos Aires!") and two_words.check("ba") and not two_words.check("Buenos")


def test_options_named_by_the_question_still_count():
    larger = TaskItem("t/l", "t", "Which is larger, 37 or 73?", "Reply with the number only.", "73",
                      options=("37", "73"))
    assert larger.check("73") and larger.check("73 is larger than 37") and larger.check("The larger number is 73.")
    assert not larger.check("37") and not larger.check("37 is larger than 73") and not larger.check(larger.prompt)
    first = TaskItem("t/f", "t", "Which is larger, 73 or 37?", "Reply with the number only.", "73", options=("73", "37"))
    assert not first.check(first.prompt) and not first.check(f"{first.question} Reply with the number")
    assert first.check(f"{first.question}\n73")


def test_answer_span_points_at_what_check_read():
    text = "40 + 2 = 42."
    start, end = NUMBER.answer_span(text)
    assert text[start:end] == "42"
    assert NUMBER.answer_span("What is 40 + 2?") is None


def test_mixture_draws_evenly_and_is_seeded():
    mixed = mixture(["add", "capital", "next"], 10, seed=1, split="eval")
    assert mixed == mixture(["add", "capital", "next"], 10, seed=1, split="eval")
    assert sorted(i.task for i in mixed) == sorted(["add"] * 4 + ["capital"] * 3 + ["next"] * 3)


def test_bad_requests_name_the_problem():
    with pytest.raises(InvalidParameterError, match="unknown task"):
        items("nope", 1, 0)
    with pytest.raises(InvalidParameterError, match="split must be one of"):
        items("add", 1, 0, split="test")
    with pytest.raises(InvalidParameterError, match="eval items, asked for"):
        items("capital", len(get_task("capital").split("eval")) + 1, 0, split="eval")
