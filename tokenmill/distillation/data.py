"""The text a distillation run trains on, as one token stream that windows are cut from.

    corpus     the training split of the Shakespeare corpus (quantization/qat.py's TRAIN_SPLIT:
               the middle half, which the perplexity text at its start never reaches)
    teacher    data-free: the teacher writes it (TeacherTextConfig), through the serving engine
               (batched sampling over a paged KV cache, as spec_heads.py has its target write
               its heads' data); kept in ``out_dir/teacher_text.json`` so that a resumed run
               trains on the same text and later runs can read what the student learned from
    chat       the teacher's answers to chat prompts (tokenmill.eval.prompts, training split),
               prompt and answer one sequence; written and kept the same way; with
               ``completion_only`` (the default for chat) a mask marks the answers' tokens,
               the only ones trained on
    FILE       any UTF-8 text file, tokenized whole

Teacher sequences are packed back to back, each ended by EOS, the way pretraining packs documents.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from tokenmill.distillation.config import DistillConfig, TeacherTextConfig
from tokenmill.engine import EngineConfig, LLMEngine
from tokenmill.errors import InvalidParameterError
from tokenmill.eval.prompts import chat_prompts
from tokenmill.models.builder import LoadedModel
from tokenmill.quantization.qat import training_ids
from tokenmill.sampling_params import SamplingParams

TEACHER_TEXT = "teacher_text.json"


def training_tokens(config: DistillConfig, teacher: LoadedModel, out_dir: Path, cache_dir: Path | None = None,
                    progress: bool = True) -> list[int]:
    """The token stream ``config.data`` names (see the module docstring)."""
    return training_data(config, teacher, out_dir, cache_dir, progress)[0]


def training_data(config: DistillConfig, teacher: LoadedModel, out_dir: Path, cache_dir: Path | None = None,
                  progress: bool = True) -> tuple[list[int], list[bool] | None]:
    """The token stream ``config.data`` names and, with ``config.completion_only``, whether the
    teacher wrote each of its tokens (False for the prompts' tokens); None without."""
    if config.data == "corpus":
        return training_ids(teacher.tokenizer, cache_dir), None
    if config.data in ("teacher", "chat"):
        sequences, prompt_lens = _teacher_record(teacher, config, out_dir, progress, config.completion_only)
        ids = [t for seq in sequences for t in seq]
        return ids, None if prompt_lens is None else completion_mask(sequences, prompt_lens)
    path = Path(config.data)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"DistillConfig.data: cannot read {path} ({exc}); give corpus, teacher or a "
                                    "UTF-8 text file") from None
    return teacher.tokenizer.encode(text, add_special_tokens=False), None


def completion_mask(sequences: list[list[int]], prompt_lens: list[int]) -> list[bool]:
    """Over the sequences packed back to back: False for each sequence's first ``prompt_lens[i]``
    tokens (its prompt), True for what the teacher wrote after them."""
    if len(sequences) != len(prompt_lens):
        raise InvalidParameterError(f"{len(sequences)} teacher sequences for {len(prompt_lens)} prompts")
    mask: list[bool] = []
    for seq, n in zip(sequences, prompt_lens):
        mask += [False] * n + [True] * (len(seq) - n)
    return mask


def teacher_text(teacher: LoadedModel, config: DistillConfig, out_dir: Path, progress: bool = True) -> list[list[int]]:
    """The teacher's sequences (each ending in EOS where the tokenizer has one): read from
    ``out_dir/teacher_text.json`` when it was written with these settings, else generated and written."""
    return _teacher_record(teacher, config, out_dir, progress, prompt_lens=False)[0]


def _teacher_record(teacher: LoadedModel, config: DistillConfig, out_dir: Path, progress: bool,
                    prompt_lens: bool = True) -> tuple[list[list[int]], list[int] | None]:
    """(sequences, the length of each one's prompt: None unless ``prompt_lens``), read or written
    as :func:`teacher_text` says."""
    settings = {"teacher_text": asdict(config.teacher_text), "seed": config.seed, "data": config.data}
    path = out_dir / TEACHER_TEXT
    if path.exists():
        saved = json.loads(path.read_text())
        if saved["settings"] != settings:
            raise InvalidParameterError(f"{path} was written with {saved['settings']}, not {settings}: use another "
                                        "output directory, or delete it to have the teacher write new text")
        sequences = saved["sequences"]
        if not prompt_lens:
            return sequences, None
        return sequences, saved.get("prompt_lens") or _prompt_lens(sequences, _prompts(teacher, config), path)
    text = config.teacher_text
    prompts = _prompts(teacher, config)
    sequences = generate(teacher, prompts, text, config.seed, progress)
    tokenizer = teacher.tokenizer
    record = {"settings": settings, "tokens": sum(map(len, sequences)), "prompt_lens": list(map(len, prompts)),
              "sequences": sequences, "text": [tokenizer.decode(s, skip_special_tokens=False) for s in sequences]}
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    return sequences, record["prompt_lens"] if prompt_lens else None


def _prompt_lens(sequences: list[list[int]], prompts: list[list[int]], path: Path) -> list[int]:
    """The prompts' lengths for a teacher text written before they were recorded: the prompts
    these settings give now, each of which its sequence must start with."""
    if len(sequences) != len(prompts) or any(s[:len(p)] != p for s, p in zip(sequences, prompts)):
        raise InvalidParameterError(f"{path} does not record its prompts and was written for other ones than "
                                    "these settings give now: train on it with completion_only=False, or delete "
                                    "it to have the teacher write new text")
    return list(map(len, prompts))


def _prompts(teacher: LoadedModel, config: DistillConfig) -> list[list[int]]:
    """What the teacher continues for ``data`` ``chat`` or ``teacher`` (the same for the same
    settings: seeded)."""
    text = config.teacher_text
    if config.data == "chat":
        return chat_prompts(teacher.tokenizer, text.sequences, config.seed, passage_chars=text.passage_chars)
    return first_tokens(teacher, text.sequences, config.seed)


def first_tokens(teacher: LoadedModel, n: int, seed: int) -> list[list[int]]:
    """``n`` prompts: BOS (if any) and one non-special token drawn uniformly (seeded)."""
    tokenizer = teacher.tokenizer
    allowed = [i for i in range(min(tokenizer.vocab_size, teacher.config.vocab_size)) if not tokenizer.is_special(i)]
    picks = torch.randint(len(allowed), (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + [allowed[i]] for i in picks]


def generate(teacher: LoadedModel, prompts: list[list[int]], config: TeacherTextConfig, seed: int,
             progress: bool = True, end_with_eos: bool = True) -> list[list[int]]:
    """The teacher continues each prompt (sampling at ``config.temperature``; greedy at 0)
    -> prompt + continuation per sequence, and EOS after one the length limit cut (packed text
    ends each sequence with it) unless not ``end_with_eos`` (only what the teacher wrote)."""
    device = teacher.model.embed.weight.device
    context, longest_prompt = teacher.config.max_position_embeddings, max(map(len, prompts))
    longest = longest_prompt + config.max_tokens
    if longest_prompt >= context:
        raise InvalidParameterError(f"the teacher's text: a prompt has {longest_prompt} tokens and the "
                                    f"teacher's context is {context}; lower teacher_text.passage_chars")
    engine = LLMEngine(teacher, device, EngineConfig.from_options(
        max_model_len=min(longest, context), max_num_seqs=min(config.sequences, 64),
        seed=seed, keep_large_buffers=False))
    requests = [engine.add_request(p, SamplingParams(temperature=config.temperature, max_tokens=config.max_tokens,
                                                     seed=seed * 100_003 + i))
                for i, p in enumerate(prompts)]
    with tqdm(total=len(requests), desc="teacher text", disable=not progress, unit="seq") as bar:
        while engine.has_unfinished_requests():
            bar.update(sum(delta.finished for delta in engine.step()))
    eos = teacher.tokenizer.eos_token_id
    stops = teacher.tokenizer.stop_token_ids
    out = []
    for request in requests:
        ids = list(request.sequences[0].all_token_ids)
        if end_with_eos and eos is not None and (not ids or ids[-1] not in stops):
            ids.append(eos)
        out.append(ids)
    return out
