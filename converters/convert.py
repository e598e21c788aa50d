"""The two conversions, streaming: HF safetensors <-> megatron-core torch_dist checkpoint.

Both walk the world-size-1 parameters in model order (converters.dist_layout), turn each into
or out of its HF tensors with the model family's mappings (converters.table), and hold one
parameter at a time. Checks run before anything is written; the output appears only
when complete (converters.atomic) and carries a manifest (converters.manifest).
"""

import shutil
from collections.abc import Iterator
from math import lcm
from pathlib import Path

import torch
from tqdm import tqdm

from backend.model.families import family_of, load_spec
from backend.model.weight_mappings import Mapping as WeightMapping
from converters.atomic import atomic_dir, check_free_space, check_target
from converters.dist_layout import Layout, build_layout
from converters.dist_read import DistReader
from converters.errors import ConversionError
from converters.hf_source import HFSource
from converters.hf_writer import ShardedWriter, TensorSpec, copy_template
from converters.manifest import ManifestWriter
from converters.readahead import ReadAhead
from converters.table import MappingError, combine_row, rows_by_name, split_row

HF_CONFIG = "hf_config.json"  # the source config.json, kept beside the dist checkpoint
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# spec fields a --target-config must share with the checkpoint
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_experts",
    "moe_ffn_hidden_size",
)


def table(spec) -> dict[str, tuple[WeightMapping, tuple[str, ...]]]:
    """World-1 mcore parameter name -> (its mapping, its HF tensor names)."""
    return rows_by_name(spec)


# ---- checks -------------------------------------------------------------------------


def check_target_config(spec, target: str | Path) -> None:
    want = load_spec(target)
    for name in SHAPE_FIELDS:
        have, need = getattr(spec, name), getattr(want, name)
        if have != need:
            raise ConversionError(
                f"{name}: checkpoint has {have}, --target-config {target} has {need}; "
                "convert the checkpoint that matches the config or fix the config"
            )


def check_plans(spec, plans: list[tuple[int, int, int, int]]) -> None:
    """Each (tp, ep, pp, etp) the output is meant to load at must suit the model."""
    from parallel.plan import ParallelPlan, PlanError, check_against_model

    for tp, ep, pp, etp in plans:
        try:
            world = lcm(tp * pp, etp * ep * pp)
            check_against_model(
                ParallelPlan(tp=tp, ep=ep, pp=pp, etp=etp, devices_per_node=world), spec
            )
        except PlanError as err:
            raise ConversionError(f"plan tp={tp} ep={ep} pp={pp} etp={etp}: {err}") from err


def _meta(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def check_hf_shapes(src: HFSource, spec, layout: Layout) -> None:
    """Every HF tensor present with the shape its parameter's split gives, none left over.

    (Splitting a meta parameter, not combining meta HF tensors: torch.cat on meta tensors
    imports torch's compiler, ~0.4 s.)"""
    rows, used = table(spec), set()
    missing = [h for _, hf in rows.values() for h in hf if h not in src.entries]
    if missing:
        raise MappingError(
            f"HF checkpoint lacks {_first(missing)}: "
            "is the checkpoint complete and for this config.json?"
        )
    for name, (row, hf) in rows.items():
        used.update(hf)
        for h, part in zip(hf, split_row(row, _meta(layout.shapes[name]), spec), strict=True):
            if src.entries[h].shape != tuple(part.shape):
                raise MappingError(
                    f"{h} has shape {src.entries[h].shape}, {name} {layout.shapes[name]} needs "
                    f"{tuple(part.shape)}: config.json and the weights disagree"
                )
    extra = sorted(
        n for n in src.entries if n not in used and not family_of(spec).hf_ignored.match(n)
    )
    if extra:
        raise MappingError(
            f"HF checkpoint has {_first(extra)} that this config "
            "does not use: does config.json (layers, experts) match the weights?"
        )


def _first(names: list[str]) -> str:
    return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")


def read_param_from_hf(
    src: HFSource, layout: Layout, row: WeightMapping, hf: tuple[str, ...], name: str, spec
) -> torch.Tensor:
    """One world-1 parameter from its HF tensors. Where the table's split of the parameter
    gives views of it (copied rows, GLU gate/up halves), each HF tensor is read straight
    into its place; otherwise (QKV regrouping) the parts are combined."""
    param = torch.empty(layout.shapes[name], dtype=layout.dtype)
    parts = split_row(row, param, spec)
    in_place = all(
        p.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
        and p.is_contiguous()
        and src.entries[h].dtype == layout.dtype
        for h, p in zip(hf, parts, strict=True)
    )
    if not in_place:
        return combine_row(row, [src[h].to(layout.dtype) for h in hf], spec)
    for h, part in zip(hf, parts, strict=True):
        src.read_into(h, part)
    return param


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else DTYPES[name]


def param_bytes(layout: Layout) -> int:
    return sum(map(layout.nbytes, layout.shapes))


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress
    )


# ---- HF -> mcore --------------------------------------------------------------------


def convert_hf_to_mcore(
    hf_dir: str | Path,
    out: str | Path,
    *,
    target_config: str | Path | None = None,
    plans: list[tuple[int, int, int, int]] = (),
    dtype: str | None = None,
    force: bool = False,
    progress: bool = False,
) -> Path:
    hf_dir, out = Path(hf_dir), Path(out).absolute()
    check_target(out, force)
    spec = load_spec(hf_dir)
    if target_config is not None:
        check_target_config(spec, target_config)
    check_plans(spec, list(plans))
    src = HFSource(hf_dir)
    layout = build_layout(spec, _dtype(dtype) or src.dtype())
    check_hf_shapes(src, spec, layout)
    check_free_space(out, param_bytes(layout))

    rows = table(spec)
    manifest = ManifestWriter("mcore-torch_dist")

    def materialize(name: str) -> torch.Tensor:
        row, hf = rows[name]
        tensor = read_param_from_hf(src, layout, row, hf, name, spec)
        manifest.add(name, tensor)
        return tensor

    from converters.dist_ckpt import save_streaming

    try:
        with (
            atomic_dir(out, force) as tmp,
            _bar(param_bytes(layout), "hf-to-mcore", progress) as bar,
            ReadAhead(layout.pieces, materialize, layout.nbytes) as params,
        ):
            hashed = save_streaming(layout, params, tmp, bar.update)
            shutil.copy2(hf_dir / "config.json", tmp / HF_CONFIG)
            manifest.write(
                tmp, hashed, source=str(hf_dir), dtype=str(layout.dtype).removeprefix("torch.")
            )
    finally:
        manifest.close()
    return out


# ---- mcore -> HF --------------------------------------------------------------------


def checkpoint_dtype(reader: DistReader, layout: Layout) -> torch.dtype:
    dtypes = {reader.dtype(p.key) for ps in layout.pieces.values() for p in ps}
    if len(dtypes) != 1:
        raise ConversionError(
            f"dist checkpoint mixes dtypes {sorted(map(str, dtypes))}: pass --dtype"
        )
    return dtypes.pop()


def check_global_shapes(reader: DistReader, layout: Layout, config: str) -> None:
    for ps in layout.pieces.values():
        for p in ps:
            have = reader.global_shape(p.key)
            # a vocab padded for TP keeps its extra rows at the end: read the first vocab_size
            padded = p.key.endswith(("word_embeddings.weight", "output_layer.weight")) and (
                have[1:] == p.global_shape[1:] and have[0] >= p.global_shape[0]
            )
            if have != p.global_shape and not padded:
                raise ConversionError(
                    f"{p.key}: checkpoint has global shape {have}, {config} implies {p.global_shape}; "
                    "pass the config the checkpoint was trained with"
                )


def read_param(reader: DistReader, layout: Layout, name: str) -> torch.Tensor:
    """One world-1 parameter assembled from the checkpoint (any saving plan). Each piece is
    read straight into its place in the parameter where it can be (same dtype, contiguous)."""
    param = torch.empty(layout.shapes[name], dtype=layout.dtype)
    for p in layout.pieces[name]:
        view = p.of(param)
        if view.is_contiguous() and reader.dtype(p.key) == param.dtype:
            reader.region(p.key, p.offset, p.shape, out=view.view(p.shape))
        else:
            view.copy_(reader.region(p.key, p.offset, p.shape).reshape(p.view[0]))
    return param


def hf_tensors(
    reader: DistReader, layout: Layout, spec, manifest: ManifestWriter
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (hub layout) tensors in model order, read ahead of the caller and queued for
    hashing as they are read (the hashing goes on while the caller's writes wait)."""
    rows = table(spec)

    def load(name: str) -> list[tuple[str, torch.Tensor]]:
        row, hf = rows[name]
        # read_param gives layout.dtype (any --dtype cast included), and its split keeps it
        tensors = list(zip(hf, split_row(row, read_param(reader, layout, name), spec), strict=True))
        for h, t in tensors:
            manifest.add(h, t)
        return tensors

    with ReadAhead(layout.shapes, load, layout.nbytes) as params:
        for name in layout.shapes:
            yield from params(name)


def hf_specs(layout: Layout, spec) -> list[TensorSpec]:
    rows, out = table(spec), []
    for name, shape in layout.shapes.items():
        row, hf = rows[name]
        parts = split_row(row, _meta(shape, layout.dtype), spec)
        out.extend(
            TensorSpec(h, tuple(t.shape), layout.dtype) for h, t in zip(hf, parts, strict=True)
        )
    return out


def load_spec_for(reader: DistReader, config: str | Path | None, template: str | Path | None):
    source = (
        config
        or template
        or (reader.root / HF_CONFIG if (reader.root / HF_CONFIG).is_file() else None)
    )
    if source is None:
        raise ConversionError(
            f"no model config for {reader.root}: pass --config or --template (an HF dir of this model)"
        )
    return load_spec(source), str(source)


def convert_mcore_to_hf(
    ckpt: str | Path,
    out: str | Path,
    *,
    template: str | Path,
    config: str | Path | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 4 << 30,
    force: bool = False,
    progress: bool = False,
    check_manifest: bool = True,
) -> Path:
    """check_manifest: every source file and chunk is checked against the source's
    manifest.json as it is read (refused without one)."""
    out, template = Path(out).absolute(), Path(template)
    check_target(out, force)
    if not (template / "config.json").is_file():
        raise ConversionError(
            f"--template {template} has no config.json: pass the original HF model dir"
        )
    reader = DistReader(ckpt, check_manifest=check_manifest)
    spec, source = load_spec_for(reader, config, template)
    layout = build_layout(spec, torch.float32)
    check_global_shapes(reader, layout, source)
    layout.dtype = _dtype(dtype) or checkpoint_dtype(reader, layout)
    specs = hf_specs(layout, spec)
    check_free_space(out, sum(s.nbytes for s in specs))

    manifest = ManifestWriter("hf-safetensors")
    try:
        with (
            atomic_dir(out, force) as tmp,
            _bar(param_bytes(layout), "mcore-to-hf", progress) as bar,
        ):
            writer = ShardedWriter(tmp, specs, max_shard_bytes)
            try:
                for name, tensor in hf_tensors(reader, layout, spec, manifest):
                    writer.write(name, tensor)
                    bar.update(tensor.nbytes)
                reader.check_unread()  # before the output can appear
                writer.close()
            finally:
                writer.abort()
            copy_template(template, tmp)
            manifest.write(
                tmp,
                writer.hashed,
                source=str(reader.root),
                dtype=str(layout.dtype).removeprefix("torch."),
            )
    finally:
        manifest.close()
    return out
