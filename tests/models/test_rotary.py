"""RoPE's (cos, sin) from the cached table equal the values computed per step, bit for bit."""

import pytest
import torch

from tokenmill.config import RopeScaling
from tokenmill.models.layers import ROPE_TABLE_POSITIONS, Rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("scaling", [None, RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=8192)],
                         ids=["plain", "llama3"])
def test_table_equals_computed(dtype, scaling):
    rope = Rotary(64, 100000.0, scaling)
    batches = [torch.tensor([3]), torch.arange(0, 200), torch.tensor([255, 256, 7]),  # grows the table
               torch.tensor([4000, 12, ROPE_TABLE_POSITIONS - 1]),
               torch.tensor([ROPE_TABLE_POSITIONS, 5]),  # past the table: computed
               torch.arange(ROPE_TABLE_POSITIONS - 3, ROPE_TABLE_POSITIONS + 3)]
    for positions in batches:
        cos, sin = rope(positions, dtype)
        ref_cos, ref_sin = rope._compute(positions, dtype)
        assert cos.dtype == dtype and cos.shape == (len(positions), 64)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert rope._tables[dtype][0].shape[0] == ROPE_TABLE_POSITIONS  # grew to the cap, no further


def test_table_is_not_state():
    """The table is a cache: not in the state dict, and a model moved to another dtype gets its own."""
    rope = Rotary(64, 10000.0)
    rope(torch.tensor([10]), torch.bfloat16)
    assert set(rope.state_dict()) == set()
    cos, _ = rope(torch.tensor([10]), torch.float32)
    assert cos.dtype == torch.float32 and torch.equal(cos, rope._compute(torch.tensor([10]), torch.float32)[0])


def test_positions_of_a_mixed_step():
    from tokenmill.attention.metadata import PagedAttentionMetadata

    meta = PagedAttentionMetadata.build([3, 1, 2], [3, 10, 6], [[[1], [2, 3], [4]]], 8)
    assert meta.positions().tolist() == [0, 1, 2, 9, 4, 5]
    assert meta.positions().dtype == torch.long
