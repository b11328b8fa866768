from __future__ import annotations

import pytest

from tokenmill.errors import InvalidParameterError
from tokenmill.quantization.config import (
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    config_from_dict,
    quantization_config_of,
)


@pytest.mark.parametrize("config", [Int8WeightOnlyConfig(), Int4WeightOnlyConfig(group_size=32, lm_head_int8=False),
                                    Int4WeightOnlyConfig(group_size=128), Int8WeightOnlyConfig(False)])
def test_to_dict_round_trips(config):
    data = config.to_dict()
    assert data["method"] == config.method
    assert config_from_dict(data) == config


def test_unknown_keys_and_methods_are_named():
    with pytest.raises(InvalidParameterError, match="'groupsize'"):
        config_from_dict({"method": "int4", "groupsize": 32})
    with pytest.raises(InvalidParameterError, match="unknown quantization method 'int3'"):
        config_from_dict({"method": "int3"})
    with pytest.raises(InvalidParameterError, match="unknown key"):
        config_from_dict({"method": "int8", "group_size": 64})


@pytest.mark.parametrize("bad", [{"group_size": 48}, {"group_size": 0}])
def test_bad_group_size(bad):
    with pytest.raises(InvalidParameterError, match="group_size"):
        Int4WeightOnlyConfig(**bad)


def test_quantization_config_of(tmp_path):
    assert quantization_config_of(tmp_path) is None
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert quantization_config_of(tmp_path) is None
    (tmp_path / "config.json").write_text('{"quantization_config": {"method": "int8"}}')
    assert quantization_config_of(tmp_path) == {"method": "int8"}
