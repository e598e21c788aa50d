"""Model directories for the launcher's checks: a header-only stand-in of a full checkpoint
(every tensor's safetensors header, sparse data: Qwen3-30B-A3B's 61 GB in a few MB of disk)
and the breakages a user's directory meets (tests/support/bad_inputs_model.py's rows)."""

import json
import math
import struct
from pathlib import Path

BYTES = {"BF16": 2, "F16": 2, "F32": 4}


def header_only(root: Path, config: dict, shards: int = 16, dtype: str = "BF16") -> Path:
    """root/: config.json, `shards` safetensors files whose headers name every tensor the
    config implies (backend's family `hf_shapes`) with data left sparse, their index, and the
    task's tokenizer with its chat template."""
    from backend.model.families import family_of, load_spec
    from recipes.local.task.doubles import write_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    spec = load_spec(config)
    shapes = family_of(spec).hf_shapes(spec)
    names = list(shapes)
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {}, 0
        for name in names[s * per : (s + 1) * per]:
            nbytes = math.prod(shapes[name]) * BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shapes[name]),
                            "data_offsets": [offset, offset + nbytes]}  # fmt: skip
            offset += nbytes
            weight_map[name] = file
        write_sparse(root / file, header, offset)
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps(config))
    write_tokenizer(root)
    return root


def write_sparse(path: Path, header: dict, data_bytes: int) -> None:
    """A safetensors file with this header and `data_bytes` of zeros the filesystem never
    stores (a hole)."""
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors pads its header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + data_bytes)


def resave(model: Path, change) -> Path:
    """model.safetensors rewritten with `change(state_dict)` applied (a tensor's dtype or
    shape altered); the index-free single-file layout the tiny model has."""
    from safetensors.torch import load_file, save_file

    path = model / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return model


def shard(model: Path, parts: int = 2) -> Path:
    """model.safetensors split into `parts` shards with their index (save_pretrained's names)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    per = math.ceil(len(names) / parts)
    weight_map = {}
    for s in range(parts):
        file = f"model-{s + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[s * per : (s + 1) * per]}
        save_file(chunk, model / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(chunk, file)
    (model / "model.safetensors").unlink()
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return model


def longer_tokenizer(model: Path, extra: int = 1) -> Path:
    """The directory's tokenizer.json with `extra` tokens past its last id (a word-level
    vocabulary, as the task's tokenizer has)."""
    path = model / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    last = max(vocab.values())
    vocab |= {f"<extra_{i}>": last + 1 + i for i in range(extra)}
    path.write_text(json.dumps(data))
    return model


def built(out: Path, changes: dict, base: dict | None = None, seed: int = 0) -> Path:
    """A Qwen3-MoE of config `base` (default: the tiny one) with `changes`, random weights
    that match them, saved by transformers (as a user's own model would be)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from parallel.models import TINY_QWEN3_MOE

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**(base or TINY_QWEN3_MOE), **changes})
    Qwen3MoeForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out
