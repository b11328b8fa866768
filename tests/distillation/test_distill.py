"""Distillation on tiny random models: the KD loss falls, an interrupted run resumes to the exact
state of an uninterrupted one, feature transfer learns its projection, the acceptance objective
raises argmax agreement, pruned zeros stay zero, the data-free mode writes and reuses the
teacher's text, QAD saves a quantized student, the CLI runs, a different vocabulary is refused,
and the saved student gives HF transformers' logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.model_utils import prompt_logits, save_byte_tokenizer  # noqa: E402
from tests.quantization.helpers import tiny_loaded  # noqa: E402
from tokenmill.distillation import distill as distill_module  # noqa: E402
from tokenmill.distillation.agreement import agreement, held_out_answers  # noqa: E402
from tokenmill.distillation.config import DistillConfig  # noqa: E402
from tokenmill.distillation.data import TEACHER_TEXT, training_data, training_tokens  # noqa: E402
from tokenmill.distillation.distill import distill, distill_models  # noqa: E402
from tokenmill.distillation.losses import distill_loss, evenly_spaced_pairs, total_variation  # noqa: E402
from tokenmill.errors import InvalidParameterError  # noqa: E402
from tokenmill.eval.prompts import chat_prompts  # noqa: E402
from tokenmill.quantization.linear import Int4Linear  # noqa: E402
from tokenmill.quantization.qat import sample_batches, training_logits  # noqa: E402
from tokenmill.training.trainer import CHECKPOINT  # noqa: E402

VOCAB = 320
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. ") * 40
TRAIN = dict(lr=1e-2, warmup_steps=2, mixed_precision=False, checkpoint_every=0)
FAST = dict(batch_size=2, seq_len=32, eval_tokens=0, save_dtype="float32")


def _config(steps: int, **options) -> DistillConfig:
    """A few fast steps (float32 matmuls, lr 1e-2) on ``options["data"]``; ``train`` entries override."""
    return DistillConfig(**{**FAST, **options, "train": {**TRAIN, "steps": steps, **options.get("train", {})}})


def _write(path: Path, hidden: int, layers: int, seed: int, sharpen: float = 1.0, vocab: int = VOCAB) -> Path:
    """A tiny random Llama as an HF directory with the byte-level tokenizer. Its own LM head (a tied
    one makes every random model predict its input token, so that any two agree); ``sharpen``
    scales it, so that the logits are far from uniform and the teacher has opinions to teach."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill")
    text = root / "text.txt"
    text.write_text(TEXT)
    return {"teacher": _write(root / "teacher", 64, 4, seed=0, sharpen=10.0),
            "student": _write(root / "student", 32, 2, seed=1), "text": text, "root": root}


def _batch(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))


def _losses(teacher, student, config: DistillConfig) -> dict[str, float]:
    """The logged terms on two fixed windows of the training text (no feature term)."""
    ids = list(TEXT.encode())
    batch = torch.tensor([ids[3:35], ids[50:82]])
    with torch.no_grad():
        return distill_loss(training_logits(student, batch), training_logits(teacher, batch), batch, config)[1]


@pytest.fixture(scope="module")
def kd_run(dirs):
    config = _config(20, data=str(dirs["text"]), eval_tokens=128, eval_every=10)
    before = tiny_loaded(dirs["student"]).model
    result = distill_models(dirs["teacher"], dirs["student"], config, dirs["root"] / "kd", progress=False)
    return config, before, result


def test_kd_lowers_the_kd_loss_and_writes_log_plot_and_student(dirs, kd_run):
    config, before, result = kd_run
    teacher = tiny_loaded(dirs["teacher"]).model
    start, end = _losses(teacher, before, config), _losses(teacher, result.student.model, config)
    assert end["kd"] < 0.8 * start["kd"]
    assert set(result.log) == {"loss", "kd", "tvd", "ce", "acceptance", "eval_step", "eval_perplexity"}
    assert len(result.log["kd"]) == 20 and result.log["eval_step"] == [10, 20]
    out = dirs["root"] / "kd"
    log = json.loads((out / "log.json").read_text())
    assert log["tokens_seen"] == 20 * 2 * 32 and log["per_step"]["kd"] == result.log["kd"]
    assert set(log["perplexity"]) == {"teacher", "student_before", "student_after"}
    assert all(v > 1 for v in log["perplexity"].values())
    # the curve's last point is the saved student (float32 here) measured the same way
    assert log["per_step"]["eval_perplexity"][-1] == pytest.approx(log["perplexity"]["student_after"], rel=1e-4)
    assert (out / "loss.png").stat().st_size > 10_000 and (out / CHECKPOINT).exists()
    saved = json.loads((result.saved / "config.json").read_text())["distillation"]
    assert saved["config"] == config.to_dict() and saved["teacher"] == "teacher" and saved["tokens_seen"] == 1280


def test_the_saved_student_gives_hf_transformers_logits(kd_run):
    result = kd_run[2]
    ids = _batch(7)[0].tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(result.saved, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    ours = tiny_loaded(result.saved).model
    assert (prompt_logits(ours, ids) - expected).abs().max().item() <= 1e-3
    assert torch.allclose(prompt_logits(result.student.model, ids), expected, atol=1e-3)


def test_an_interrupted_run_resumes_to_the_state_of_an_uninterrupted_one(dirs, monkeypatch):
    config = _config(6, data=str(dirs["text"]), feature_weight=0.5,
                     train={"checkpoint_every": 2, "mixed_precision": True, "grad_accum": 2})
    whole = dirs["root"] / "whole"
    distill_models(dirs["teacher"], dirs["student"], config, whole, progress=False)

    cut = dirs["root"] / "cut"
    calls = {"n": 0}
    real = distill_module.distill_loss

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 7:  # in step 4, after the checkpoint of step 2 and the update of step 3
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(distill_module, "distill_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill_models(dirs["teacher"], dirs["student"], config, cut, progress=False)
    checkpoint = torch.load(cut / CHECKPOINT, weights_only=False)
    assert checkpoint["step"] == 2
    # the student of that checkpoint, written beside it, loads on its own and is that state
    latest = cut / distill_module.LATEST
    assert json.loads((latest / "config.json").read_text())["distillation"]["checkpoint_step"] == 2
    at_two = tiny_loaded(dirs["student"]).model
    at_two.load_state_dict(checkpoint["modules"]["student"])
    with torch.no_grad():
        assert torch.equal(training_logits(tiny_loaded(latest).model, _batch()), training_logits(at_two, _batch()))
    monkeypatch.setattr(distill_module, "distill_loss", real)
    resumed = distill_models(dirs["teacher"], dirs["student"], config, cut, progress=False)
    assert resumed.resumed_at == 2 and len(resumed.log["loss"]) == 6
    assert json.loads((latest / "config.json").read_text())["distillation"]["checkpoint_step"] == 4
    assert sorted(p.name for p in cut.iterdir() if p.name.startswith(distill_module.LATEST)) == [
        distill_module.LATEST]  # no half-written or stale copy left

    a, b = (torch.load(d / CHECKPOINT, weights_only=False) for d in (whole, cut))
    assert a["step"] == b["step"] == 6 and a["log"] == b["log"]
    for name in ("student", "features"):
        assert a["modules"][name].keys() == b["modules"][name].keys()
        assert all(torch.equal(a["modules"][name][k], b["modules"][name][k]) for k in a["modules"][name])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert a["scheduler"] == b["scheduler"]


def test_feature_transfer_learns_a_projection(dirs):
    config = _config(15, data=str(dirs["text"]), feature_weight=1.0, kd_weight=0.0, ce_weight=0.0)
    result = distill_models(dirs["teacher"], dirs["student"], config, dirs["root"] / "features", progress=False)
    feature = result.log["feature"]
    assert sum(feature[-3:]) < 0.8 * sum(feature[:3])
    state = torch.load(dirs["root"] / "features" / CHECKPOINT, weights_only=False)["modules"]["features"]
    assert sorted(state) == ["proj.0.weight", "proj.1.weight"]  # student 32 wide, teacher 64: one per pair
    torch.manual_seed(config.seed)
    initial = torch.nn.Linear(32, 64, bias=False).weight
    assert state["proj.0.weight"].shape == (64, 32) and not torch.equal(state["proj.0.weight"], initial)
    assert evenly_spaced_pairs(2, 4) == ((0, 1), (1, 3))


def test_the_acceptance_objective_raises_argmax_agreement(dirs):
    config = _config(20, data=str(dirs["text"]), objective="acceptance", ce_weight=0.5, eval_every=10,
                     agreement_prompts=3, agreement_tokens=8)
    teacher, before = tiny_loaded(dirs["teacher"]).model, tiny_loaded(dirs["student"]).model
    result = distill_models(dirs["teacher"], dirs["student"], config, dirs["root"] / "accept", progress=False)
    start, end = _losses(teacher, before, config), _losses(teacher, result.student.model, config)
    assert end["acceptance"] > start["acceptance"] + 0.1 and end["tvd"] < start["tvd"]
    assert "ce_argmax" in result.log
    # held-out agreement on the teacher's greedy chat answers: before, while (steps 10, 20) and after
    agreed = result.agreement
    assert agreed["teacher"] == 1.0 and all(0.0 <= agreed[k] <= 1.0 for k in ("student_before", "student_after"))
    assert result.log["eval_step"] == [10, 20] and len(result.log["eval_agreement"]) == 2
    assert "eval_perplexity" not in result.log  # eval_tokens 0: agreement alone
    assert json.loads((dirs["root"] / "accept" / "log.json").read_text())["agreement"] == agreed
    p = torch.tensor([[0.0, 1.0, 0.0]])
    assert total_variation(p.log(), torch.tensor([[0.0, 0.0, 1.0]]).log()).item() == pytest.approx(1.0)
    assert total_variation(p.log(), p.log()).item() == pytest.approx(0.0)


def test_agreement_counts_the_answer_positions_where_the_argmax_is_the_teachers_token(dirs):
    teacher = tiny_loaded(dirs["teacher"])
    answers = held_out_answers(teacher, 3, 8, seed=0)
    prompts = chat_prompts(teacher.tokenizer, 3, 0, split="eval")
    assert [p for p, _ in answers] == prompts and all(1 <= len(a) <= 8 for _, a in answers)
    assert agreement(teacher.model, answers) == 1.0  # its own greedy answers, no EOS added after the 8th
    # each answer's last token changed (no compared position reads it): those positions disagree
    changed = [(p, a[:-1] + [(a[-1] + 1) % VOCAB]) for p, a in answers]
    total = sum(len(a) for _, a in answers)
    assert agreement(teacher.model, changed) == pytest.approx((total - len(answers)) / total)
    assert agreement(teacher.model, [(prompts[0], [])]) != agreement(teacher.model, [(prompts[0], [])])  # nan


@pytest.mark.parametrize("keep", [True, False], ids=["keep_sparsity", "no_keep"])
def test_a_pruned_students_zeros_stay_zero(dirs, keep, tmp_path):
    student = tiny_loaded(dirs["student"])
    gate_up = student.model.layers[0].mlp.gate_up.weight
    with torch.no_grad():
        gate_up[:, ::2] = 0  # half of the layer's weights, as unstructured pruning leaves it
    zeros = gate_up == 0
    config = _config(4, data=str(dirs["text"]), keep_sparsity=keep)
    distill(tiny_loaded(dirs["teacher"]), student, config, tmp_path, progress=False)
    after = student.model.layers[0].mlp.gate_up.weight
    assert bool((after[zeros] == 0).all()) is keep
    assert (after != 0).float().mean() > 0.45  # the kept half trained on


@pytest.mark.parametrize("keep", [True, False], ids=["keep_sparsity", "no_keep"])
def test_a_sparse_pruned_student_is_saved_as_pruned_so_the_loader_runs_its_zeros_sparse(dirs, keep, tmp_path):
    from tokenmill.pruning.api import prune, save_pruned
    from tokenmill.pruning.config import MagnitudeConfig

    pruned, report = prune(str(dirs["student"]), MagnitudeConfig(sparsity=0.5), progress=False)
    source = save_pruned(pruned, report, tmp_path / "pruned", torch.float32)
    result = distill(tiny_loaded(dirs["teacher"]), tiny_loaded(source), _config(2, data=str(dirs["text"]),
                     keep_sparsity=keep), tmp_path / "out", progress=False)
    saved = json.loads((result.saved / "config.json").read_text())
    assert "distillation" in saved
    if keep:  # the zeros held: the student says what made them, as the pruned model did
        assert saved["pruning_config"] == json.loads((source / "config.json").read_text())["pruning_config"]
        assert (result.student.model.layers[0].mlp.gate_up.weight == 0).float().mean().item() >= 0.5
    else:
        assert "pruning_config" not in saved


def test_the_data_free_mode_writes_the_teachers_text_and_trains_on_it(dirs, tmp_path):
    config = _config(3, data="teacher", teacher_text={"sequences": 4, "max_tokens": 24})
    teacher = tiny_loaded(dirs["teacher"])
    distill(teacher, tiny_loaded(dirs["student"]), config, tmp_path, progress=False)
    record = json.loads((tmp_path / TEACHER_TEXT).read_text())
    sequences = record["sequences"]
    assert len(sequences) == 4 and record["tokens"] == sum(map(len, sequences))
    assert all(len(s) >= 2 and s[-1] == 256 for s in sequences)  # prompt token, the teacher's text, EOS
    assert len({tuple(s) for s in sequences}) == 4
    assert record["text"][0] == teacher.tokenizer.decode(sequences[0], skip_special_tokens=False)
    # the teacher wrote it: its own text is far likelier under it than random bytes are
    own = torch.tensor([s[:24] for s in sequences if len(s) >= 24][:2])
    noise = torch.randint(0, 256, own.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        nll = [torch.nn.functional.cross_entropy(training_logits(teacher.model, x)[:, :-1].reshape(-1, VOCAB),
                                                 x[:, 1:].reshape(-1)).item() for x in (own, noise)]
    assert nll[0] < 0.75 * nll[1]
    assert training_tokens(config, teacher, tmp_path) == [t for s in sequences for t in s]  # read back, not rewritten
    other = dataclasses.replace(config, seed=1)
    with pytest.raises(InvalidParameterError, match="was written with"):
        training_tokens(other, teacher, tmp_path)


def test_the_chat_mode_trains_on_the_teachers_greedy_answers_to_chat_prompts(dirs, tmp_path):
    config = _config(2, data="chat", teacher_text={"sequences": 3, "max_tokens": 12, "temperature": 0.0,
                                                   "passage_chars": 100})
    teacher = tiny_loaded(dirs["teacher"])
    distill(teacher, tiny_loaded(dirs["student"]), config, tmp_path, progress=False)
    sequences = json.loads((tmp_path / TEACHER_TEXT).read_text())["sequences"]
    prompts = chat_prompts(teacher.tokenizer, 3, config.seed, passage_chars=100)
    assert [s[:len(p)] for s, p in zip(sequences, prompts)] == prompts  # each: a chat prompt, then the answer
    assert all(len(s) > len(p) for s, p in zip(sequences, prompts))
    # greedy: the answer is the teacher's argmax continuation, token by token
    seq, n = sequences[0], len(prompts[0])
    with torch.no_grad():
        logits = training_logits(teacher.model, torch.tensor([seq]))[0]
    answer = seq[n:n + 12]  # (an EOS after 12 tokens is the one generate appends)
    assert logits[n - 1:n - 1 + len(answer)].argmax(-1).tolist() == answer


def test_chat_data_trains_on_the_answers_alone(dirs, tmp_path):
    """completion_only (chat's default): the mask marks exactly the tokens after each prompt, a
    teacher text written before prompt lengths were recorded gets them from its prompts, and
    one written for other prompts is refused rather than masked wrongly."""
    config = _config(2, data="chat", teacher_text={"sequences": 3, "max_tokens": 10, "temperature": 0.0,
                                                   "passage_chars": 100})
    assert config.completion_only and not dataclasses.replace(config, completion_only=False).completion_only
    teacher = tiny_loaded(dirs["teacher"])
    result = distill(teacher, tiny_loaded(dirs["student"]), config, tmp_path, progress=False)
    record = json.loads((tmp_path / TEACHER_TEXT).read_text())
    prompts = chat_prompts(teacher.tokenizer, 3, config.seed, passage_chars=100)
    assert record["prompt_lens"] == [len(p) for p in prompts]
    ids, trained = training_data(config, teacher, tmp_path)
    expected = [t for s, p in zip(record["sequences"], prompts) for t in [False] * len(p) + [True] * (len(s) - len(p))]
    assert trained == expected and len(ids) == len(trained) and 0 < sum(trained) < len(trained)
    assert all(0 <= a <= 1 for a in result.log["acceptance"])
    del record["prompt_lens"]  # an older teacher text: the prompts these settings give are checked against it
    (tmp_path / TEACHER_TEXT).write_text(json.dumps(record))
    assert training_data(config, teacher, tmp_path)[1] == expected
    record["sequences"][1] = record["sequences"][1][1:]
    (tmp_path / TEACHER_TEXT).write_text(json.dumps(record))
    with pytest.raises(InvalidParameterError, match="completion_only=False"):
        training_data(config, teacher, tmp_path)
    assert training_data(dataclasses.replace(config, completion_only=False), teacher, tmp_path)[1] is None


def test_masked_positions_do_not_count():
    """A position outside the mask changes no term of the loss; an all-true mask is no mask."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 6), generator=g)
    student, teacher = torch.randn(2, 6, 50, generator=g), torch.randn(2, 6, 50, generator=g) * 3
    mask = torch.tensor([[False, False, True, True, True, False], [True, True, False, False, True, True]])
    for objective in ("kd", "acceptance"):
        config = DistillConfig(objective=objective)
        loss, values = distill_loss(student, teacher, ids, config, trained=mask)
        other_teacher, other_ids = teacher.clone(), ids.clone()
        other_teacher[~mask] = torch.randn(int((~mask).sum()), 50, generator=g) * 3
        other_ids[0, 1] = (ids[0, 1] + 1) % 50  # the next token of a masked position
        other_loss, other_values = distill_loss(student, other_teacher, other_ids, config, trained=mask)
        assert torch.allclose(loss, other_loss) and values == pytest.approx(other_values)
        other_teacher[0, 2] += 5 * torch.randn(50, generator=g)  # a trained position: it counts
        assert not torch.allclose(distill_loss(student, other_teacher, ids, config, trained=mask)[0], loss)
        full, full_values = distill_loss(student, teacher, ids, config, trained=torch.ones_like(mask))
        plain, plain_values = distill_loss(student, teacher, ids, config)
        assert torch.allclose(full, plain) and full_values == pytest.approx(plain_values)
    zero, _ = distill_loss(student, teacher, ids, DistillConfig(), trained=torch.zeros_like(mask))
    assert zero.item() == 0.0  # a window with nothing to train on: no loss, no NaN


def test_masked_windows_are_the_same_windows():
    ids = list(range(100, 400))
    trained = [i % 7 < 3 for i in range(len(ids))]
    plain = list(sample_batches(ids, 3, 2, 16, seed=4, device=torch.device("cpu")))
    masked = list(sample_batches(ids, 3, 2, 16, seed=4, device=torch.device("cpu"), trained=trained))
    for windows, (same, mask) in zip(plain, masked):
        assert torch.equal(windows, same) and mask.dtype == torch.bool and mask.shape == windows.shape
        # position j of a window: whether the token after it is trained on (the stream's last: never)
        for row, mrow in zip(windows.tolist(), mask.tolist()):
            assert mrow == [i + 1 - 100 < len(ids) and trained[i + 1 - 100] for i in row]


def test_quantization_aware_distillation_saves_a_quantized_student_that_loads(dirs, tmp_path):
    from tokenmill.loader import load_model

    config = _config(4, data=str(dirs["text"]), qat=32)
    result = distill_models(dirs["teacher"], dirs["student"], config, tmp_path, progress=False)
    assert isinstance(result.student.model.layers[0].mlp.down, Int4Linear)
    saved = json.loads((result.saved / "config.json").read_text())
    assert saved["quantization_config"]["method"] == "int4" and saved["quantization_config"]["group_size"] == 32
    assert saved["distillation"]["config"]["qat"]["group_size"] == 32
    loaded = load_model(str(result.saved), torch.float32, "cpu")
    assert isinstance(loaded.model.layers[1].attn.qkv, Int4Linear)
    ids = _batch(3)[0].tolist()
    assert torch.allclose(prompt_logits(loaded.model, ids), prompt_logits(result.student.model, ids), atol=1e-4)


def test_the_distill_command_runs_and_prints_a_summary(dirs, tmp_path, capsys):
    from tokenmill.cli import main

    out = tmp_path / "cli"
    assert main(["distill", "--teacher", str(dirs["teacher"]), "--student", str(dirs["student"]), "--out", str(out),
                 "--steps", "2", "--seq-len", "16", "--batch-size", "1", "--eval-tokens", "64",
                 "--data", str(dirs["text"]), "--float32-matmuls"]) == 0
    printed = capsys.readouterr().out
    assert "perplexity on 64 held-out tokens: teacher" in printed and "32 tokens seen" in printed
    assert "greedy agreement" not in printed  # a kd run, none asked
    assert f"wrote {out / 'student'}" in printed
    assert (out / "student" / "model.safetensors").exists() and (out / "log.json").exists()


def test_the_completion_only_flag():
    from tokenmill.cli import build_parser
    from tokenmill.commands.distill import distill_config

    base = ["distill", "--teacher", "t", "--student", "s", "--out", "o"]
    parse = build_parser().parse_args
    assert distill_config(parse(base + ["--data", "chat"])).completion_only
    assert not distill_config(parse(base + ["--data", "chat", "--no-completion-only"])).completion_only
    with pytest.raises(InvalidParameterError, match="completion_only needs data='chat'"):
        distill_config(parse(base + ["--completion-only"]))


def test_freeze_embedding_keeps_the_students_embedding(dirs, tmp_path):
    """--freeze-embedding: the saved student's embedding (and tied head) is the one it started with,
    while its layers moved."""
    from safetensors.torch import load_file

    from tokenmill.cli import main
    from tokenmill.loader import load_model

    out = tmp_path / "frozen"
    assert main(["distill", "--teacher", str(dirs["teacher"]), "--student", str(dirs["student"]), "--out", str(out),
                 "--steps", "2", "--seq-len", "16", "--batch-size", "1", "--eval-tokens", "0", "--lr", "1e-2",
                 "--data", str(dirs["text"]), "--float32-matmuls", "--freeze-embedding"]) == 0
    before = load_model(str(dirs["student"]), torch.float32, "cpu").model
    after = load_file(str(out / "student" / "model.safetensors"))
    assert torch.equal(after["model.embed_tokens.weight"].float(), before.embed.weight.to(torch.bfloat16).float())
    moved = after["model.layers.0.mlp.down_proj.weight"].float()
    assert not torch.equal(moved, before.layers[0].mlp.down.weight.to(torch.bfloat16).float())
    assert json.loads((out / "log.json").read_text())["config"]["train_embedding"] is False


def test_a_bad_flag_value_is_one_line_of_error(dirs, tmp_path, capsys):
    from tokenmill.cli import main

    assert main(["distill", "--teacher", "t", "--student", "s", "--out", str(tmp_path), "--objective", "mse"]) == 2
    assert "DistillConfig.objective" in capsys.readouterr().err


def test_a_student_with_another_vocabulary_is_refused(dirs, tmp_path, capsys):
    from tokenmill.cli import main

    other = _write(tmp_path / "other", 32, 2, seed=2, vocab=300)
    assert main(["distill", "--teacher", str(dirs["teacher"]), "--student", str(other), "--out",
                 str(tmp_path / "out")]) == 2
    assert "vocab_size 300 (student) vs 320 (teacher)" in capsys.readouterr().err
    swapped = _write(tmp_path / "swapped", 32, 2, seed=2)  # same size, two tokens' ids exchanged
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InvalidParameterError, match="token id 97 is 'b' for the student, 'a' for the teacher"):
        distill(tiny_loaded(dirs["teacher"]), tiny_loaded(swapped), _config(1), tmp_path / "out2",
                progress=False)


@pytest.mark.parametrize("data,match", [
    ({"objective": "mse"}, "objective"), ({"temperature": 0.0}, "temperature"), ({"train": {"steps": 0}}, "steps"),
    ({"train": {"learning_rate": 1e-3}}, "TrainConfig: unknown key.*learning_rate"),
    ({"seq_len": 1}, "seq_len"), ({"kd_weight": -1.0}, "kd_weight"), ({"save_dtype": "int8"}, "save_dtype"),
    ({"kd_weight": 0.0, "ce_weight": 0.0}, "nothing to train"), ({"qat": 48}, "group_size"),
    ({"qat": {"group_size": 32, "steps": 5}}, "unknown key.*steps"), ({"feature_layers": [[0, -1]]}, "feature_layers"),
    ({"teacher_text": {"sequences": 0}}, "sequences"), ({"eval_every": 5, "eval_tokens": 0}, "eval_every"),
    ({"learning_rate": 1e-4}, "unknown key.*learning_rate"), ({"completion_only": True}, "completion_only.*chat"),
    ({"completion_only": "yes"}, "completion_only"), ({"agreement_prompts": -1}, "agreement_prompts"),
    ({"agreement_tokens": 0}, "agreement_tokens")])
def test_the_config_rejects_bad_values_naming_the_field(data, match):
    with pytest.raises(InvalidParameterError, match=match):
        DistillConfig.from_dict(data)


def test_the_config_round_trips_through_its_dict():
    config = DistillConfig(objective="acceptance", qat={"group_size": 32}, feature_weight=0.5,
                           feature_layers=[[0, 1], [1, 3]], teacher_text={"sequences": 8}, train={"steps": 7})
    assert DistillConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    chat = DistillConfig(data="chat")
    assert chat.completion_only and not DistillConfig().completion_only
    assert DistillConfig.from_dict(json.loads(json.dumps(chat.to_dict()))) == chat
    assert config.feature_layers == ((0, 1), (1, 3)) and config.qat.group_size == 32
    assert config.train.steps == 7 and config.train.lr == DistillConfig().train.lr == 1e-4  # the rest: the defaults
    # a draft's run measures its held-out agreement unless told not to; a kd run only when asked
    assert config.agreement_prompts == 8 and DistillConfig().agreement_prompts == 0
    assert DistillConfig(objective="acceptance", agreement_prompts=0).agreement_prompts == 0
    assert DistillConfig(eval_every=5, eval_tokens=0, agreement_prompts=2).eval_every == 5


def test_the_library_verb_trains_a_student_held_in_memory(dirs, tmp_path):
    """``tokenmill.distill(teacher, student, config, out)``: the teacher a model argument, the
    student a LoadedModel trained in place (the object returned is the one passed)."""
    import tokenmill

    student = tiny_loaded(dirs["student"])
    before = {k: v.clone() for k, v in student.model.state_dict().items()}
    result = tokenmill.distill(str(dirs["teacher"]), student, _config(3, data=str(dirs["text"])), tmp_path / "kd",
                               progress=False)
    assert result.student is student and len(result.log["kd"]) == 3
    assert any(not torch.equal(before[k], v) for k, v in student.model.state_dict().items())
    assert (tmp_path / "kd" / "student" / "config.json").exists()
