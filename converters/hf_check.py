"""An HF model directory checked against its own config.json before anything loads it.

Headers only (safetensors' 8-byte length and JSON header; no tensor byte is read), so the
whole Qwen3-30B-A3B (61 GB) is checked in about a second:
- the index and the shards agree: no shard missing or truncated, every tensor where the index
  says, no tensor the index does not name;
- every tensor the config implies (the family's `hf_shapes`, hub or fused experts) is there,
  with its shape; none is left over; one dtype throughout (config.json's `dtype` /
  `torch_dtype` when it names one);
- a tokenizer that loads, with a chat template (verl's dataloader applies it to every
  prompt), no longer than the embedding rows, and EOS / pad ids inside the vocabulary.
Each failure is one CheckpointError line: the file, the first offending tensor, how many
others, and the fix.
"""

import json
from collections import Counter
from pathlib import Path

from backend.model.families import ConfigError, family_of, load_spec, read_config
from backend.shared.errors import CheckpointError
from converters.hf_io import INDEX, SINGLE
from converters.hf_source import HFSource

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
FIX_WEIGHTS = "does config.json match the weights? save both with save_pretrained"


def check_hf_dir(root: Path, label: str) -> None:
    """Every check above, in order; `label` names the directory as the user gave it."""
    try:
        config = read_config(root)
        spec = load_spec(config)
    except ConfigError as e:
        raise CheckpointError(f"{label}: config.json: {e}") from None
    source = _source(root, label)
    check_tensors(source, spec, label)
    check_dtypes(source, config, label)
    check_tokenizer(root, spec.vocab_size, label)


def _source(root: Path, label: str) -> HFSource:
    """The shards' headers, checked against the files and the index."""
    index = root / INDEX
    if not index.is_file() and not (root / SINGLE).is_file():
        raise CheckpointError(
            f"{label} has no safetensors weights ({SINGLE} or {INDEX} and its shards): save "
            "the model there with save_pretrained(safe_serialization=True)"
        )
    try:
        source = HFSource(root)
    except (CheckpointError, json.JSONDecodeError, KeyError, OSError) as e:
        raise CheckpointError(f"{label}: {e}") from None
    if not index.is_file():
        return source
    named = json.loads(index.read_text())["weight_map"]
    orphans = sorted({p.name for p in root.glob("*.safetensors")} - set(named.values()))
    if orphans:
        raise CheckpointError(
            f"{label}: {_first(orphans, 'shard')} is not in {INDEX}, so no loader reads it: "
            "re-save the checkpoint (save_pretrained writes both) or restore the index"
        )
    unnamed = [n for n in source.entries if n not in named]
    if unnamed:
        raise CheckpointError(
            f"{label}: {source.entries[unnamed[0]].file.name} holds {_first(unnamed)}, which "
            f"{INDEX} does not name: re-save the checkpoint (save_pretrained writes both)"
        )
    return source


def check_tensors(source: HFSource, spec, label: str) -> None:
    """Names and shapes against what the config implies."""
    family = family_of(spec)
    present = {n: e for n, e in source.entries.items() if not family.hf_ignored.match(n)}
    expected = family.hf_shapes(spec, family.has_fused_hf(present))
    missing = [n for n in expected if n not in present]
    if missing:
        raise CheckpointError(
            f"{label}: config.json implies {_first(missing)}, which no shard holds "
            f"({_sizes(spec)}): {FIX_WEIGHTS}"
        )
    extra = [n for n in present if n not in expected]
    if extra:
        raise CheckpointError(
            f"{label}: {present[extra[0]].file.name} holds {_first(extra)}, which config.json "
            f"does not imply ({_sizes(spec)}): {FIX_WEIGHTS}"
        )
    wrong = [n for n in expected if tuple(present[n].shape) != expected[n]]
    if wrong:
        name = wrong[0]
        raise CheckpointError(
            f"{label}: {present[name].file.name}: {_first(wrong, 'tensor')} is "
            f"{list(present[name].shape)} where config.json implies {list(expected[name])} "
            f"({_sizes(spec)}): {FIX_WEIGHTS}"
        )


def check_dtypes(source: HFSource, config: dict, label: str) -> None:
    """One floating dtype: config.json's when it names one, else the one most tensors have."""
    floats = {n: e for n, e in source.entries.items() if e.dtype.is_floating_point}
    if not floats:
        return
    named = config.get("dtype") or config.get("torch_dtype")
    want = (
        str(named) if named else Counter(str(e.dtype) for e in floats.values()).most_common(1)[0][0]
    )
    want = want.removeprefix("torch.")
    odd = [n for n, e in floats.items() if str(e.dtype).removeprefix("torch.") != want]
    if odd:
        got = str(floats[odd[0]].dtype).removeprefix("torch.")
        said = "config.json's dtype" if named else "the other tensors' dtype"
        raise CheckpointError(
            f"{label}: {floats[odd[0]].file.name}: {_first(odd, 'tensor')} is {got}, not "
            f"{want} ({said}): save every weight in {want}"
        )


def check_tokenizer(root: Path, vocab_size: int, label: str) -> None:
    """The tokenizer verl and vLLM load: present, loadable, templated, inside the vocabulary."""
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"{label} has no tokenizer ({', '.join(TOKENIZER_FILES)}): save the model's "
            "tokenizer there (tokenizer.save_pretrained)"
        )
    if not _has_chat_template(root):
        raise CheckpointError(
            f"{label} has no chat template (chat_template.jinja, or chat_template in "
            "tokenizer_config.json), which verl's dataloader applies to every prompt: save "
            "one with the tokenizer (tokenizer.chat_template = ...; save_pretrained)"
        )
    tokenizer = _load_tokenizer(root, label)
    if len(tokenizer) > vocab_size:
        raise CheckpointError(
            f"{label}: the tokenizer has {len(tokenizer)} tokens, more than the "
            f"{vocab_size} embedding rows (config.json's vocab_size): ids past "
            f"{vocab_size - 1} have no embedding; save the model's own tokenizer with it"
        )
    for where, name, value in _special_ids(root, tokenizer):
        if value is not None and not 0 <= value < vocab_size:
            raise CheckpointError(
                f"{label}: {where}'s {name} {value} lies outside the vocabulary (vocab_size "
                f"{vocab_size}): set it to the tokenizer's own id"
            )


def _load_tokenizer(root: Path, label: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(root)
    except (OSError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(
            f"{label}: its tokenizer does not load ({first}): save a tokenizer transformers "
            "loads (AutoTokenizer.from_pretrained) with the model"
        ) from None


def _special_ids(root: Path, tokenizer):
    """(file, key, id) of every EOS and pad id the run reads: config.json,
    generation_config.json and the tokenizer's own."""
    for file in ("config.json", "generation_config.json"):
        path = root / file
        config = json.loads(path.read_text()) if path.is_file() else {}
        for key in ("eos_token_id", "pad_token_id"):
            values = config.get(key)
            for value in values if isinstance(values, list) else [values]:
                yield file, key, value
    yield "the tokenizer", "eos_token_id", tokenizer.eos_token_id
    yield "the tokenizer", "pad_token_id", tokenizer.pad_token_id


def _has_chat_template(root: Path) -> bool:
    if (root / "chat_template.jinja").is_file() or (root / "chat_template.json").is_file():
        return True
    tokenizer_config = root / "tokenizer_config.json"
    if not tokenizer_config.is_file():
        return False
    try:
        return bool(json.loads(tokenizer_config.read_text()).get("chat_template"))
    except json.JSONDecodeError:
        return False


def _first(names: list[str], what: str = "") -> str:
    more = (
        f" (and {len(names) - 1} more{' ' + what + 's' if what else ''})" if len(names) > 1 else ""
    )
    return f"{names[0]}{more}"


def _sizes(spec) -> str:
    return (
        f"num_hidden_layers {spec.num_layers}, hidden_size {spec.hidden_size}, num_experts "
        f"{spec.num_experts}, moe_intermediate_size {spec.moe_ffn_hidden_size}, vocab_size "
        f"{spec.vocab_size}"
    )
