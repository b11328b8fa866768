"""Every entry point offers the config dataclasses' options with the same name, default and help.

The configs (LoadConfig, EngineConfig, SchedulerConfig, CacheConfig, ServerConfig) declare each
option once; ``LLM(...)``, ``tokenmill serve``, ``tokenmill bench offline``, ``tokenmill eval
perplexity`` and ``tokenmill quantize`` are compared with them field by field here.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from tokenmill.cli import build_parser
from tokenmill.config import LoadConfig
from tokenmill.engine import ENGINE_OPTIONS, CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.llm import LLM
from tokenmill.options import flag_name, number, option_fields
from tokenmill.server.config import CostConfig, ServerConfig


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def _expected(cls: type, exclude: tuple[str, ...] = (), only: tuple[str, ...] | None = None):
    return [f for f in option_fields(cls, only=only, exclude=exclude) if f.metadata["cli"]]


def _check_flags(parser: argparse.ArgumentParser, fields, positional_model: bool = False) -> None:
    actions = _actions(parser)
    for f in fields:
        if positional_model and f.name == "model":
            action = actions["model"]
            assert action.option_strings == [] and action.default == f.default, f.name
            assert action.help.startswith(f.metadata["help"]), (f.name, action.help)
            continue
        assert f.name in actions, f"{parser.prog} has no flag for {f.name}"
        action = actions[f.name]
        assert flag_name(f.name) in action.option_strings, (f.name, action.option_strings)
        assert action.default == f.default, (parser.prog, f.name, action.default, f.default)
        assert action.help.startswith(f.metadata["help"]), (parser.prog, f.name, action.help)
        if f.metadata["choices"]:
            assert tuple(action.choices) == f.metadata["choices"], f.name


ENGINE_FIELDS = [f for cls in ENGINE_OPTIONS for f in _expected(cls)]


def test_serve_offers_every_load_engine_server_and_cost_option() -> None:
    serve = _subparser(build_parser(), "serve")
    _check_flags(serve, _expected(LoadConfig, exclude=("model",)) + ENGINE_FIELDS + _expected(ServerConfig)
                 + _expected(CostConfig))
    model = _actions(serve)["model"]  # several models: --model NAME=SOURCE, repeated
    assert model.option_strings == ["--model", "-m"] and isinstance(model, argparse._AppendAction)
    args = build_parser().parse_args(["serve", "--model", "a=x.gguf", "-m", "b=y"])
    assert args.model == ["a=x.gguf", "b=y"] and args.model_pos is None


def test_bench_offline_offers_every_load_and_engine_option() -> None:
    offline = _subparser(build_parser(), "bench", "offline")
    # --seed there is the workload's seed; every request of the benchmark is greedy
    _check_flags(offline, _expected(LoadConfig) + [f for f in ENGINE_FIELDS if f.name != "seed"])


def test_eval_and_quantize_offer_the_load_options_and_the_kv_cache_storage() -> None:
    parser = build_parser()
    _check_flags(_subparser(parser, "eval", "perplexity"),
                 _expected(LoadConfig) + _expected(CacheConfig, only=("block_size", "kv_cache_dtype")),
                 positional_model=True)
    _check_flags(_subparser(parser, "quantize"), _expected(LoadConfig), positional_model=True)


def test_generate_and_chat_offer_the_load_and_engine_options() -> None:
    parser = build_parser()
    for name in ("generate", "chat"):  # their --seed is the request's sampling seed
        _check_flags(_subparser(parser, name), _expected(LoadConfig) + [f for f in ENGINE_FIELDS if f.name != "seed"])


def test_llm_takes_every_load_and_engine_option_by_name_with_its_default() -> None:
    params = inspect.signature(LLM).parameters
    expected = [f for cls in (LoadConfig, *ENGINE_OPTIONS) for f in option_fields(cls)]
    assert list(params) == [f.name for f in expected] + ["speculative"]  # and vLLM's speculative={...} dict
    assert params["speculative"].default is None
    for f in expected:
        assert params[f.name].default == f.default, f.name
        assert f.metadata["help"] in " ".join(LLM.__doc__.split()), f.name


def test_each_default_is_the_dataclass_default() -> None:
    # the entry points read defaults from the fields, so the fields are the one place they live
    assert SchedulerConfig().max_num_seqs == 64 and SchedulerConfig().max_num_batched_tokens == 2048
    assert CacheConfig().kv_cache_memory == 0.1 and CacheConfig().block_size == 16
    assert EngineConfig().scheduler == SchedulerConfig() and EngineConfig().cache == CacheConfig()


def test_parsed_flags_build_the_configs() -> None:
    args = build_parser().parse_args(["serve", "--max-num-seqs", "8", "--no-enable-chunked-prefill",
                                      "--kv-cache-memory", "2147483648", "--no-enable-prefix-caching",
                                      "--policy", "fcfs", "--port", "0", "--api-keys", "keys.json",
                                      "--retry-after", "3"])
    config = EngineConfig.from_namespace(args)
    assert config.scheduler == SchedulerConfig(max_num_seqs=8, enable_chunked_prefill=False, policy="fcfs")
    assert config.cache == CacheConfig(kv_cache_memory=2**31, enable_prefix_caching=False)
    from tokenmill.options import from_namespace

    assert from_namespace(ServerConfig, args) == ServerConfig(port=0, api_keys="keys.json", retry_after=3)


def test_kv_cache_memory_below_one_is_a_fraction_and_one_or_more_is_bytes() -> None:
    assert number("0.25") == 0.25 and number("1") == 1 and isinstance(number("2e9"), int)
    fraction = CacheConfig(kv_cache_memory=0.5)
    import torch

    free = fraction.budget_bytes(torch.device("cpu"))
    assert 0 < free and CacheConfig(kv_cache_memory=1).budget_bytes(torch.device("cpu")) == 1
    assert CacheConfig(kv_cache_memory=4096).budget_bytes(torch.device("cpu")) == 4096


@pytest.mark.parametrize("cls", [LoadConfig, EngineConfig, SchedulerConfig, CacheConfig, ServerConfig])
def test_configs_refuse_unknown_keys_by_name(cls) -> None:
    with pytest.raises(InvalidParameterError, match="'max_num_seq'"):
        cls.from_dict({"max_num_seq": 3})


def test_unknown_engine_option_is_refused_naming_it_and_the_known_ones() -> None:
    with pytest.raises(InvalidParameterError, match=r"'max_num_seq'.*known options are .*max_num_seqs"):
        EngineConfig.from_options(max_num_seq=3)


@pytest.mark.parametrize("bad, match", [
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"policy": "lifo"}, "policy"), ({"block_size": 0}, "block_size"),
    ({"kv_cache_memory": 0}, "kv_cache_memory"), ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
    ({"max_model_len": 1}, "max_model_len"),
])
def test_bad_values_are_refused_naming_the_field(bad: dict, match: str) -> None:
    with pytest.raises(InvalidParameterError, match=match):
        EngineConfig.from_options(**bad)


def test_every_option_field_has_a_one_line_help() -> None:
    for cls in (LoadConfig, *ENGINE_OPTIONS, ServerConfig):
        fields = option_fields(cls)
        assert fields, cls
        for f in fields:
            assert f.metadata["help"] and "\n" not in f.metadata["help"], (cls.__name__, f.name)
        plain = [f.name for f in dataclasses.fields(cls) if "help" not in f.metadata]
        assert plain in ([], ["scheduler", "cache", "speculative", "lora"]), (cls.__name__, plain)
