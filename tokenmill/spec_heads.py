"""Training EAGLE heads (engine/spec/eagle.py) on text the target model itself generates.

    tokenmill spec train-heads MODEL --out DIR        (or train_eagle_head(MODEL, DIR, HeadTrainingConfig()))

1. data      the target answers ``prompts`` chat prompts, half built from the training half of the corpus
             (summarise, continue, explain, rewrite, question a passage), half generic requests (task x
             topic: explain, poem, tips, story, code, email, ...), with temperature sampling;
             each prompt + answer is one training sequence. Its hidden states (final, before the norm,
             as the engine computes them) come from the same model. Saved to ``DIR/data.pt`` once.
2. vocab     the ``draft_vocab`` most frequent tokens of those sequences: the head's output rows.
3. training  position p of a window: the head reads (f_{p-1}, t_p) and predicts f_p. Loss: smooth L1
             to the true f_p, plus ``cls_weight`` x cross entropy of the head's draft-vocabulary
             distribution against the target's (its logits on the same rows), the EAGLE recipe;
             ``unroll`` steps, step j reading the head's own step j - 1 predictions (as drafting does). The
             shared trainer (training/trainer.py): AdamW, warm-up + cosine, gradient accumulation,
             checkpoints every ``checkpoint_every`` steps in ``DIR``, resume after an interruption.
4. report    on held-out sequences (the last tenth): how often the head's top token is the target's
             top token at the next position, from true features (an estimate of the first draft
             token's acceptance), and at step 2 from the head's own features (the second token's);
             written into ``DIR/eagle.json`` beside the settings and losses.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.spec.eagle import EagleHead
from tokenmill.errors import InvalidParameterError
from tokenmill.eval.prompts import chat_prompts
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.training.attention import CausalSDPABackend, training_attention
from tokenmill.training.trainer import TrainConfig, Trainer

DATA_FILE = "data.pt"
@dataclass(frozen=True)
class HeadTrainingConfig:
    prompts: int = 192
    """Training sequences the target generates (one answer per prompt)."""
    max_tokens: int = 256
    """Longest answer per prompt."""
    temperature: float = 0.8
    """Sampling temperature of the answers (varied text; greedy answers of a small model loop)."""
    passage_chars: int = 1200
    """Longest corpus passage in a prompt (characters; the shortest is a quarter of it)."""
    draft_vocab: int = 8192
    """Output rows of the head: the most frequent tokens of the training text."""
    steps: int = 300
    batch_size: int = 4
    """Windows per micro-batch."""
    seq_len: int = 256
    """Tokens per window."""
    grad_accum: int = 1
    lr: float = 3e-4
    warmup_steps: int = 20
    cls_weight: float = 0.1
    """Weight of the distribution loss beside the hidden-state regression (EAGLE: 0.1)."""
    unroll: int = 2
    """Drafting steps trained: step j reads the head's own step j - 1 predictions as features, as
    drafting does after its first token (EAGLE-3's training-time test); 1: true features only."""
    checkpoint_every: int = 50
    mixed_precision: bool = True
    seed: int = 0
    texts: tuple[str, ...] = ()
    """Train on these instead of generating: ``teacher_text.json`` files of ``tokenmill distill --data chat``
    (or ``teacher``) runs whose teacher is this model; their sequences (prompt and answer) are the
    training text and ``prompts``, ``max_tokens``, ``temperature``, ``passage_chars`` go unused."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "texts", tuple(self.texts))
        for name in ("prompts", "max_tokens", "draft_vocab", "batch_size", "seq_len"):
            if getattr(self, name) <= 0:
                raise InvalidParameterError(f"train-heads: {name} must be positive, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise InvalidParameterError(f"train-heads: seq_len must be at least 2, got {self.seq_len}")

    def train_config(self) -> TrainConfig:
        return TrainConfig(steps=self.steps, lr=self.lr, warmup_steps=self.warmup_steps, grad_accum=self.grad_accum,
                           mixed_precision=self.mixed_precision, checkpoint_every=self.checkpoint_every)


def generate_data(llm: LLM, config: HeadTrainingConfig, progress: bool = True) -> list[dict[str, torch.Tensor]]:
    """Training sequences: the target's answers to the prompts (or the sequences of ``config.texts``),
    with its hidden states."""
    if config.texts:
        seqs = saved_sequences(config.texts, llm.model_config.vocab_size)
    else:
        prompts = chat_prompts(llm.tokenizer, config.prompts, config.seed, passage_chars=config.passage_chars)
        params = [SamplingParams(temperature=config.temperature, seed=config.seed * 100_003 + i,
                                 max_tokens=config.max_tokens) for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=progress)
        seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    runner = ModelRunner.for_sequences(llm.engine.runner.model, max(len(s) for s in seqs))
    data = []
    for ids in tqdm(seqs, desc="hidden states", disable=not progress):
        hidden = runner.hidden(ids).float().cpu()
        data.append({"ids": torch.tensor(ids, dtype=torch.long), "hidden": hidden})
    return data


def saved_sequences(paths: tuple[str, ...], vocab_size: int) -> list[list[int]]:
    """The token sequences of ``teacher_text.json`` files (tokenmill.distillation.data), in order."""
    seqs: list[list[int]] = []
    for path in paths:
        try:
            saved = json.loads(Path(path).read_text())
            found = saved["sequences"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidParameterError(f"train-heads: {path} is not a teacher_text.json of `tokenmill distill` "
                                        f"({type(exc).__name__}: {exc})") from None
        bad = [t for s in found for t in s if not 0 <= t < vocab_size][:1]
        if bad:
            raise InvalidParameterError(f"train-heads: {path} holds token {bad[0]}, outside this model's vocabulary "
                                        f"of {vocab_size}: it was written by another model")
        seqs += [s for s in found if len(s) > 1]
    if not seqs:
        raise InvalidParameterError(f"train-heads: no sequences in {', '.join(paths)}")
    return seqs


def draft_vocabulary(data: list[dict[str, torch.Tensor]], size: int, vocab_size: int) -> torch.Tensor:
    counts = torch.bincount(torch.cat([d["ids"] for d in data]), minlength=vocab_size)
    return counts.topk(min(size, vocab_size)).indices.sort().values


def _windows(data: list[dict[str, torch.Tensor]], config: HeadTrainingConfig):
    """Endless seeded micro-batches (ids, features, truth, mask): ``batch_size`` windows of seq_len
    positions p = s .. s + seq_len - 1 of a sequence, with t_p, f_{p-1} (zeros before position 0, as
    the engine feeds it) and f_p; a short sequence is padded, its pad positions masked out."""
    g = torch.Generator().manual_seed(config.seed)
    usable = [d for d in data if len(d["ids"]) > 1]
    width = config.seq_len
    while True:
        ids, feats, truth, mask = [], [], [], []
        for _ in range(config.batch_size):
            d = usable[int(torch.randint(len(usable), (1,), generator=g))]
            n = min(width, len(d["ids"]))
            s = int(torch.randint(len(d["ids"]) - n + 1, (1,), generator=g))
            before = d["hidden"][s - 1:s] if s > 0 else torch.zeros_like(d["hidden"][:1])
            pad = width - n
            ids.append(F.pad(d["ids"][s:s + n], (0, pad)))
            feats.append(F.pad(torch.cat([before, d["hidden"][s:s + n - 1]]), (0, 0, 0, pad)))
            truth.append(F.pad(d["hidden"][s:s + n], (0, 0, 0, pad)))
            mask.append(torch.arange(width) < n)
        yield torch.stack(ids), torch.stack(feats), torch.stack(truth), torch.stack(mask)


def head_loss(head: EagleHead, target, ids: torch.Tensor, feats: torch.Tensor, truth: torch.Tensor,
              target_rows: torch.Tensor, cls_weight: float, valid: torch.Tensor | None = None,
              unroll: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """ids [B, S] (t_p), feats [B, S, H] (f_{p-1}), truth [B, S, H] (f_p) -> (loss, {"l1", "ce", "top1"},
    and "l1_J", "ce_J", "top1_J" for unrolled step J >= 2)."""
    b, s = ids.shape
    positions = torch.arange(s).repeat(b)
    truth = truth.reshape(b * s, -1)
    keep = valid.reshape(-1) if valid is not None else torch.ones(b * s, dtype=torch.bool)
    with torch.no_grad():
        teacher = (head_norm_target(target, truth[keep]) @ target_rows.T).float()
        teacher_p = teacher.softmax(-1)
    total, out = 0.0, {}
    inputs = feats
    with training_attention(head, CausalSDPABackend(b, s)):
        embeddings = target.embed_tokens(ids.reshape(-1)).float()
        local = head.config.layer_type(0) == "sliding" and target.config.rope_local_theta
        rope = (target.rotary_local if local else target.rotary_global)(positions, embeddings.dtype)
        for step in range(unroll):
            pred = head(inputs.reshape(b * s, -1), embeddings, rope, None, None)
            l1 = F.smooth_l1_loss(pred[keep].float(), truth[keep])
            student = head.draft_logits(pred[keep]).float()
            ce = -(teacher_p * student.log_softmax(-1)).sum(-1).mean()
            total = total + (l1 + cls_weight * ce) / unroll
            top1 = (student.argmax(-1) == teacher.argmax(-1)).float().mean().item()
            tag = "" if step == 0 else f"_{step + 1}"
            out.update({f"l1{tag}": l1.item(), f"ce{tag}": ce.item(), f"top1{tag}": top1})
            # the next step reads position p - 1's prediction where it read the target's f_{p-1}
            inputs = torch.cat([feats[:, :1], pred.view(b, s, -1)[:, :-1].to(feats.dtype)], dim=1)
    return total, out


def head_norm_target(target, h: torch.Tensor) -> torch.Tensor:
    return target.norm(h.to(target.embed.weight.dtype)).float()


def train_eagle_head(model: str, out_dir: str | Path, config: HeadTrainingConfig = HeadTrainingConfig(),
                     progress: bool = True, **llm_options: Any) -> dict:
    """Generate data (or reuse ``out_dir/data.pt``), train (resuming from a checkpoint there), save
    the head into ``out_dir`` -> what ``eagle.json`` records. The target runs in float32 unless
    ``dtype`` says otherwise (a head trained on it drafts for the model in any dtype)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if llm_options.get("dtype", "auto") == "auto":  # dense float weights: the head starts from the last block
        llm_options = {**llm_options, "dtype": "float32"}
    llm = LLM(model, **llm_options)
    target = llm.engine.runner.model
    data_path = out / DATA_FILE
    if data_path.exists():
        data = torch.load(data_path, weights_only=False)
    else:
        data = generate_data(llm, config, progress)
        torch.save(data, data_path)
    held = max(1, len(data) // 10)
    train, test = data[:-held], data[-held:]
    vocab = draft_vocabulary(train, config.draft_vocab, llm.model_config.vocab_size)
    head = EagleHead.initialised_from(target, vocab)
    weight = target.lm_head.weight if target.lm_head is not None else target.embed.weight
    rows = weight[vocab].float().detach()
    target.requires_grad_(False)
    head.norm.requires_grad_(False)  # the target's final norm, as the target applies it

    def loss_fn(batch):
        ids, feats, truth, mask = batch
        return head_loss(head, target, ids, feats, truth, rows, config.cls_weight, mask, config.unroll)

    trainer = Trainer({"head": head}, config.train_config(), out, desc="EAGLE head", progress=progress)
    log = trainer.fit(_windows(train, config), loss_fn)
    head.eval()
    with torch.no_grad():
        scores = []
        for d in test:
            feats = torch.cat([torch.zeros_like(d["hidden"][:1]), d["hidden"][:-1]])
            scores.append(head_loss(head, target, d["ids"][None], feats[None], d["hidden"][None], rows,
                                    config.cls_weight, unroll=max(2, config.unroll))[1])
    report = {"target": llm.model_name, "training": asdict(config), "train_sequences": len(train),
              "train_tokens": int(sum(len(d["ids"]) for d in train)), "held_out_sequences": len(test),
              "held_out_top1": sum(s["top1"] for s in scores) / max(len(scores), 1),
              "held_out_top1_step2": sum(s["top1_2"] for s in scores) / max(len(scores), 1),
              "held_out_l1": sum(s["l1"] for s in scores) / max(len(scores), 1),
              "final_loss": sum(log.values["loss"][-10:]) / len(log.values["loss"][-10:]),
              "resumed_at": log.resumed_at}
    head.save(out, report)
    return report
