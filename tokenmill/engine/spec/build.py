"""The configured proposer, built over the engine's model (and the draft model, when one is given)."""

from __future__ import annotations

import logging
from functools import partial

from tokenmill.attention.kv_cache import PagedKVCache
from tokenmill.engine.config import SpeculativeConfig
from tokenmill.engine.kv_cache_manager import KVCacheCoordinator
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.spec.cost import CostCurve
from tokenmill.engine.spec.draft_model import DraftModelProposer, check_same_tokenizer, layer_skip_model
from tokenmill.engine.spec.drafter import Drafter
from tokenmill.engine.spec.ngram import NgramProposer
from tokenmill.errors import InvalidParameterError
from tokenmill.models.builder import LoadedModel

logger = logging.getLogger("tokenmill.engine")


def build_drafter(config: SpeculativeConfig, target: LoadedModel, draft: LoadedModel | None, sampler: Sampler,
                  num_tokens: int, block_size: int, target_kv: KVCacheCoordinator | None = None,
                  target_cache: PagedKVCache | None = None) -> Drafter | None:
    """None without speculative decoding. ``num_tokens``: how many tokens a draft model's own KV pool
    holds (the target's pool and every sequence's draft); ``draft``: the loaded draft_model;
    ``target_kv``, ``target_cache``: the target's block tables and cache (a shortlist draft's)."""
    method = config.speculative_method
    if method is None:
        return None
    if method == "ngram":
        return Drafter(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
    if method == "shortlist":  # over the target's own KV: no pool of its own
        from tokenmill.engine.spec.shortlist import ShortlistProposer, model_ranking, shortlist, shortlist_model

        if target_kv is None or target_cache is None:
            raise ValueError("speculative_method shortlist drafts in the target's KV cache: pass target_kv and "
                             "target_cache")
        vocab = shortlist(model_ranking(target.model, target.tokenizer), config.draft_vocab_size)
        name = f"shortlist({len(vocab)})"
        draft_cost = CostCurve(grows=True)  # its passes are the model's layers: dearer with every sequence
        proposer = ShortlistProposer(shortlist_model(target.model, vocab), target_kv, target_cache, sampler,
                                     draft_cost.observe, name)
        where = "in the model's own KV cache"
    else:
        make, name = _own_kv_proposer(config, target, draft)
        num_blocks = -(-num_tokens // block_size) + 1
        draft_cost = CostCurve()
        proposer = make(num_blocks, block_size, sampler, draft_cost.observe, name)
        where = f"its own KV of {num_blocks} blocks"
    logger.info("speculative decoding: %s, up to %d tokens a step, %s", name, config.num_speculative_tokens, where)
    return Drafter(config, proposer, draft_cost)


def _own_kv_proposer(config: SpeculativeConfig, target: LoadedModel, draft: LoadedModel | None):
    """(the proposer's constructor but for its KV pool's size, block size, sampler, cost observer and
    name; its name) for the methods that draft with a model over a KV pool of their own."""
    method = config.speculative_method
    if method == "layerskip":
        total = target.config.num_layers
        layers = config.layer_skip_layers or max(1, total // 2)
        if not 1 <= layers < total:
            raise InvalidParameterError(f"layer_skip_layers must be in 1..{total - 1} for a {total}-layer model, "
                                        f"got {layers}")
        return partial(DraftModelProposer, layer_skip_model(target.model, list(range(layers)))), \
            f"layerskip({layers})"
    if method == "eagle":
        from tokenmill.engine.spec.eagle import EagleHead, EagleProposer

        head = EagleHead.load(config.draft_model, target.model)
        return partial(EagleProposer, head, target.model), \
            f"eagle({config.draft_model}, draft vocabulary {len(head.vocab)})"
    if method == "draft":
        if draft is None:
            raise InvalidParameterError("speculative_method draft: the draft model was not loaded")
        check_same_tokenizer(target.tokenizer, draft.tokenizer, config.draft_model)
        return partial(DraftModelProposer, draft.model), f"draft({draft.source.name})"
    raise ValueError(f"no proposer for {method!r}")  # SpeculativeConfig checked the name
