"""Calibration: text for the methods that look at activations, and what they measure on it.

    calibration_ids(ctx, n, seq_len)    ``ctx.calibration``, or n sequences from the end of the
                                        corpus (perplexity, measured on its start, never reaches them)
    observe_inputs(model, observers)    the float model over those sequences, each named layer's
                                        input fed to its observer
    calibrate_inputs                    w8a8 static: each layer's activation grid (scale, zero point)
    input_absmax                        SmoothQuant: max |x| per input channel of each layer
    input_mean_squares                  int4 activation_weighted: mean x^2 per input channel

Every whole-sequence pass runs through a :meth:`ModelRunner.for_sequences
<tokenmill.engine.model_runner.ModelRunner.for_sequences>` runner, the model's own forward over
a throwaway paged KV cache. A tied LM head has no module of its own: its input is the output of
the final norm.
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.engine.model_runner import ModelRunner
from tokenmill.errors import InvalidParameterError
from tokenmill.eval.corpus import fetch_corpus
from tokenmill.models.base import CausalLM
from tokenmill.quantization.config import W8A8Config
from tokenmill.quantization.observers import MinMaxObserver, Observer, make_observer
from tokenmill.quantization.targets import QuantizeContext


def calibration_ids(ctx: QuantizeContext, num_samples: int, seq_len: int, method: str) -> list[list[int]]:
    """``ctx.calibration``, or else ``num_samples`` sequences of ``seq_len`` tokens from the end of
    the corpus (perplexity, measured on its start, never reaches them)."""
    if ctx.calibration is not None:
        return ctx.calibration
    if ctx.tokenizer is None:
        raise InvalidParameterError(f"{method} calibrates on text: quantize a model name or a LoadedModel "
                                    "(which carry a tokenizer), or pass calibration token ids")
    text = fetch_corpus(ctx.cache_dir).read_text(encoding="utf-8")
    need = num_samples * seq_len
    ids = ctx.tokenizer.encode(text[-8 * need:], add_special_tokens=False)[-need:]
    if len(ids) < need:
        raise InvalidParameterError(f"the corpus gave {len(ids)} calibration tokens, {need} needed")
    return [ids[i:i + seq_len] for i in range(0, need, seq_len)]


def observe_inputs(model: CausalLM, observers: dict[str, Observer], samples: list[list[int]], desc: str,
                   progress: bool) -> None:
    """Run ``samples`` (token ids) through the float model, feeding the input of each layer named
    in ``observers`` to its observer.

    A tied LM head has no module of its own; its input is the output of the final norm."""
    handles = []
    for name, observer in observers.items():
        if name == "lm_head" and model.lm_head is None:
            handles.append(model.norm.register_forward_hook(lambda m, args, out, o=observer: o.update(out)))
        else:
            handles.append(model.get_submodule(name).register_forward_pre_hook(
                lambda m, args, o=observer: o.update(args[0])))
    runner = ModelRunner.for_sequences(model, max(len(s) for s in samples))
    try:
        with torch.inference_mode():
            for ids in tqdm(samples, desc=desc, disable=not progress, unit="seq"):
                hidden = runner.hidden(ids)
                if "lm_head" in observers:
                    model.compute_logits(hidden)
    finally:
        for handle in handles:
            handle.remove()


def calibrate_inputs(model: CausalLM, names: list[str], config: W8A8Config, ctx: QuantizeContext,
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The static activation grid of each layer in ``names``: its calibration inputs fed to its
    own ``config.observer`` -> {name: (scale, zero_point)} per tensor."""
    samples = calibration_ids(ctx, config.calibration_samples, config.seq_len, "w8a8 static")
    observers = {name: make_observer(config.observer, config.symmetric, None, config.percentile) for name in names}
    observe_inputs(model, observers, samples, f"calibrating w8a8 ({config.observer})", ctx.progress)
    return {name: observer.qparams() for name, observer in observers.items()}  # ordinary tensors, not inference ones


def input_absmax(model: CausalLM, names: list[str], config: W8A8Config, ctx: QuantizeContext,
                 ) -> dict[str, torch.Tensor]:
    """max |x| per input channel of each layer in ``names`` over the calibration text: {name: [K]}."""
    samples = calibration_ids(ctx, config.calibration_samples, config.seq_len, "w8a8 smoothing")
    observers = {name: MinMaxObserver(symmetric=True, axis=-1) for name in names}
    observe_inputs(model, observers, samples, "calibrating smoothing", ctx.progress)
    return {name: torch.maximum(-o.lo, o.hi).clone() for name, o in observers.items()}


class MeanSquareHooks:
    """Forward pre-hooks accumulating the mean square of each input column of some linear layers
    (float32 [K]): the diagonal of H / tokens, llama.cpp's "importance matrix"."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self.add(name, args[0])
        return hook

    def add(self, name: str, x: torch.Tensor) -> None:
        """Count inputs x [..., K] of layer ``name``."""
        x = x.reshape(-1, x.shape[-1]).float()
        self.sums[name] = self.sums.get(name, 0) + (x * x).sum(dim=0)
        self.counts[name] = self.counts.get(name, 0) + x.shape[0]

    def mean_squares(self) -> dict[str, torch.Tensor]:
        return {name: total / self.counts[name] for name, total in self.sums.items()}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def input_mean_squares(model: CausalLM, names: list[str], samples: list[list[int]],
                       progress: bool = True) -> dict[str, torch.Tensor]:
    """Each named linear layer's input mean square per column [K] over ``samples`` run through the
    (float) model. A tied LM head, which has no module, gets the final norm's output's."""
    modules = {n: model.get_submodule(n) for n in names if n != "lm_head" or model.lm_head is not None}
    hooks = MeanSquareHooks(modules)
    runner = ModelRunner.for_sequences(model, max(len(s) for s in samples))
    try:
        with torch.inference_mode():
            for ids in tqdm(samples, desc="input mean squares", disable=not progress, unit="seq"):
                hidden = runner.hidden(ids)
                if "lm_head" in modules:
                    model.compute_logits(hidden)
                elif "lm_head" in names:
                    hooks.add("lm_head", model.norm(hidden))
    finally:
        hooks.remove()
    return hooks.mean_squares()
