"""converters.hf_check: an HF model directory against its config.json, from headers only.
The launcher's rows (one line each, before Ray) are in tests/support/bad_inputs_model.py; here
the checker itself, at the tiny and mini models and at Qwen3-30B-A3B's full size."""

import json
import math
import time

import pytest
from safetensors import safe_open

from backend.model.families import family_of, load_spec
from backend.shared.errors import CheckpointError
from converters.hf_check import check_hf_dir
from parallel.models import QWEN3_30B_A3B
from tests.support.model_dirs import header_only, write_sparse

pytestmark = pytest.mark.no_mcore  # reads headers; nothing of megatron-core


@pytest.mark.parametrize("name", ["tiny", "mini"])
def test_the_family_shapes_are_what_transformers_saves(name, tmp_path):
    """Catches hf_shapes drifting from the real layout (a transposed projection, a fused
    expert tensor the hub layout does not have): every name and shape of a saved model."""
    from recipes.local.task.hf_checkpoints import make_checkpoint

    model = make_checkpoint(tmp_path / name, name, seed=0)
    with safe_open(model / "model.safetensors", framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    spec = load_spec(model)
    assert family_of(spec).hf_shapes(spec) == saved


def test_qwen3_30b_a3b_is_checked_in_seconds_from_its_headers(tmp_path):
    """The mission's model: 18,867 tensors in 16 shards (61 GB, sparse here) pass; the check
    reads headers only, so it takes seconds, not a load of 61 GB."""
    model = header_only(tmp_path / "q", QWEN3_30B_A3B)
    assert sum(p.stat().st_size for p in model.glob("*.safetensors")) > 60e9
    started = time.perf_counter()
    check_hf_dir(model, "--model q")
    assert time.perf_counter() - started < 15.0


def test_fused_experts_are_read_as_transformers_5_writes_them(tmp_path):
    from parallel.models import TINY_QWEN3_MOE

    config = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe", "dtype": "float32"}
    spec = load_spec(config)
    shapes = family_of(spec).hf_shapes(spec, fused=True)
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    model = header_only(tmp_path / "m", config, shards=1, dtype="F32")
    for path in model.glob("model*"):
        path.unlink()
    write_sparse(model / "model.safetensors", header, offset)
    check_hf_dir(model, "--model m")
    del header["model.layers.1.mlp.experts.down_proj"]
    write_sparse(model / "model.safetensors", header, offset - 4 * 8 * 64 * 32)
    with pytest.raises(CheckpointError, match=r"implies model.layers.1.mlp.experts.down_proj,"):
        check_hf_dir(model, "--model m")


def _edit_header(path, change) -> None:
    """Rewrite a shard's header with change(header) (data offsets kept)."""
    import struct

    with open(path, "rb") as f:  # the header only: the data is GBs of holes
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    change(header)
    data = max(m["data_offsets"][1] for k, m in header.items() if k != "__metadata__")
    write_sparse(path, header, data)


@pytest.mark.parametrize(
    "break_it, words",
    [
        (
            lambda m: _edit_header(
                m / "model-00003-of-00016.safetensors",
                lambda h: h[next(k for k in h if k.endswith("up_proj.weight"))].update(dtype="F16"),
            ),
            "model-00003-of-00016.safetensors: model.layers.",
        ),
        (
            lambda m: (m / "generation_config.json").write_text(
                '{"eos_token_id": [151645, 151936]}'
            ),
            "generation_config.json's eos_token_id 151936 lies outside the vocabulary",
        ),
        (
            lambda m: (m / "model.safetensors.index.json").write_text(
                json.dumps(
                    {
                        "weight_map": {
                            k: v
                            for k, v in json.loads(
                                (m / "model.safetensors.index.json").read_text()
                            )["weight_map"].items()
                            if k != "lm_head.weight"
                        }
                    }
                )
            ),
            "holds lm_head.weight, which model.safetensors.index.json does not name",
        ),
    ],
    ids=["dtype", "eos_id", "unindexed"],
)
def test_the_full_model_broken_one_way_at_a_time(tmp_path, break_it, words):
    """At the mission's shape (128 experts x 48 layers): one tensor of another dtype, an EOS id
    past the vocabulary, a tensor the index forgot; each one line naming it."""
    model = header_only(tmp_path / "q", QWEN3_30B_A3B)
    break_it(model)
    with pytest.raises(CheckpointError) as caught:
        check_hf_dir(model, "--model q")
    line = str(caught.value)
    assert "\n" not in line and words in line and line.startswith("--model q: "), line
