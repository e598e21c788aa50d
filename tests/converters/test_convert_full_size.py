"""The full-size converter benchmark's sparse checkpoint: every real tensor, random ends, holes
between, and readable as a normal HF checkpoint (what lets a 61 GB run fit one model of disk)."""

import torch

from converters.hf_source import HFSource


def _bench():
    from scripts.bench import convert_full_size

    return convert_full_size


def test_sparse_checkpoint_has_real_shapes_random_ends_and_holes(world1, tmp_path):
    bench = _bench()
    specs = bench.write_sparse(tmp_path / "hf", layers=1, shard_bytes=1 << 30)
    src = HFSource(tmp_path / "hf")
    assert {s.name: s.shape for s in specs} == {n: e.shape for n, e in src.entries.items()}
    assert len(src.files) == 3  # 2.49 GB in shards of at most 1 GiB, with index.json checked
    apparent = sum(f.stat().st_size for f in src.files) / bench.GB
    assert apparent > 2.4 and bench.disk_gb(tmp_path / "hf") < 0.05

    mark = bench.MARK // 2  # bf16 elements
    heads = []
    for name in ["model.layers.0.mlp.experts.127.down_proj.weight", "lm_head.weight"]:
        flat = src[name].reshape(-1)
        assert bool((flat[:mark] != 0).all()) and bool((flat[-mark:] != 0).all()), name
        assert not bool(flat[mark:-mark].any()), name
        heads.append(flat[:mark])
    assert not torch.equal(*heads)  # each tensor its own values: a misplaced one shows
    norm = src["model.layers.0.input_layernorm.weight"]  # small: random throughout
    assert bool((norm != 0).all())
