"""Test helpers: run a tokenmill model over whole prompts and compare with HF transformers."""

from __future__ import annotations

import torch

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.attention.metadata import PagedAttentionMetadata
from tokenmill.config import layer_groups
from tokenmill.models.base import CausalLM

BLOCK = 16


@torch.inference_mode()
def prompt_logits(model: CausalLM, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits [len(ids), vocab] for every position, optionally prefilled in chunks, through a paged
    KV cache whose blocks 1, 2, ... hold the sequence (block 0 is the null block)."""
    cfg, device = model.config, model.embed.weight.device
    groups, windows = layer_groups(cfg)
    num_blocks = -(-len(ids) // BLOCK) + 1
    cache = PagedKVCache(num_blocks, BLOCK, groups, cfg.num_kv_heads, cfg.head_dim, model.embed.weight.dtype, device)
    table = list(range(1, num_blocks))
    chunk = chunk or len(ids)
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        meta = PagedAttentionMetadata.build([len(piece)], [start + len(piece)], [[table]] * len(windows), BLOCK,
                                            device)
        hidden = model(torch.tensor(piece, device=device), meta.positions(device), cache, meta)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


def save_byte_tokenizer(path) -> None:
    """A byte-level tokenizer with no merges (256 byte tokens + <|endoftext|> = id 256) saved
    as tokenizer.json / tokenizer_config.json, so a tiny random checkpoint loads like a real one."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tokenmill.loading.tokenizer import byte_alphabet

    vocab = {ch: i for i, ch in enumerate(byte_alphabet().values())}
    vocab["<|endoftext|>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))
