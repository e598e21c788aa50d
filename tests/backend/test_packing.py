"""backend.model.packing (verl-free) builds the packed row layout exactly as the engine's
recipes/dapo/batches.packed_micro_batch does from a verl batch: cu_seqlens (with the tp tail),
PackedSeqParams, the packed ids and the has-next mask."""

import pytest
import torch

from backend.model.packing import packed_layout

LENGTH_SETS = [  # (lengths, tp): with and without a tail, one sequence, tp 1
    ([5, 7, 3], 1),
    ([12, 15, 6], 4),
    ([8, 8], 4),
    ([1], 2),
    ([9, 1, 30, 2, 17], 8),
]


def _verl_batch(seqs):
    from verl.utils import tensordict_utils as tu

    return tu.list_of_dict_to_tensordict([dict(input_ids=s) for s in seqs])


@pytest.mark.parametrize("lengths,tp", LENGTH_SETS)
def test_layout_matches_the_engines_packed_micro_batch(lengths, tp):
    from recipes.dapo.engine.batches import packed_micro_batch

    gen = torch.Generator().manual_seed(len(lengths) * 31 + tp)
    seqs = [torch.randint(1, 100, (n,), generator=gen) for n in lengths]
    mb = packed_micro_batch(_verl_batch(seqs), list(range(len(seqs))), tp=tp, device="cpu")
    layout = packed_layout(lengths, tp)
    assert layout.cu_seqlens.dtype == mb.cu_seqlens.dtype == torch.int32
    assert layout.cu_seqlens.tolist() == mb.cu_seqlens.tolist()
    assert len(layout.cu_seqlens) == len(lengths) + (2 if layout.tail else 1)
    assert layout.total % tp == 0 and layout.total == mb.ids_BS.shape[1]
    assert torch.equal(layout.pack(seqs), mb.ids_BS)
    assert torch.equal(layout.has_next(), mb.has_next_BS)
    ours, theirs = layout.params, mb.packed
    assert ours.qkv_format == theirs.qkv_format == "thd"
    assert torch.equal(ours.cu_seqlens_q, theirs.cu_seqlens_q)
    assert torch.equal(ours.cu_seqlens_kv, theirs.cu_seqlens_kv)
    assert (ours.max_seqlen_q, ours.max_seqlen_kv) == (theirs.max_seqlen_q, theirs.max_seqlen_kv)


def test_tail_and_bad_input():
    layout = packed_layout([12, 15, 6], tp=4)
    assert layout.cu_seqlens.tolist() == [0, 12, 27, 33, 36]
    assert (layout.real, layout.total, layout.tail, layout.max_seqlen) == (33, 36, 3, 15)
    assert packed_layout([3, 1], tp=8).max_seqlen == 4  # the tail is the longest "sequence"
    with pytest.raises(ValueError, match="non-empty"):
        packed_layout([3, 0])
    with pytest.raises(ValueError, match="tp must be"):
        packed_layout([3], tp=0)
    with pytest.raises(ValueError, match="sequence lengths"):
        layout.pack([torch.zeros(3)])
