"""Weights in and out of the sharded actor: HF load, per-tensor HF export, checkpoints (their
layout and when one is complete: recipes.dapo.checkpoints.files)."""

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from backend.qwen3_moe import Qwen3MoeSpec
from backend.shared.errors import CheckpointError
from backend.training.distributed import ProcessGroups
from converters.hf_source import HFSource
from converters.sharding import iter_full
from converters.table import expand_table, split_row
from recipes.dapo.checkpoints.files import META, OPTIM_DIR, check_complete

FORMAT = "mcore-moe-dapo/torch_dist/1"


def hf_tensors(
    module,
    groups: ProcessGroups,
    spec: Qwen3MoeSpec,
    headers: dict | None = None,
    bucket_bytes: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF hub name, full tensor) per tensor of the whole model on every rank, for rollout
    weight sync (vLLM's names). Collective: every rank iterates to the end.

    headers: a dict the caller keeps between calls (see all_stages). bucket_bytes: gather in
    buckets of at most that many bytes of full tensors (converters.buckets; 0: per tensor).
    The names, values and order are the same either way."""
    rows = {mcore: (row, hf) for row, mcore, hf in expand_table(spec)}
    stream = all_stages(module, groups, spec, headers if headers is not None else {}, bucket_bytes)
    for key, tensor in stream:
        row, hf_names = rows[key]
        yield from zip(hf_names, split_row(row, tensor, spec), strict=True)


def all_stages(
    module, groups: ProcessGroups, spec: Qwen3MoeSpec, headers: dict, bucket_bytes: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """converters.sharding.iter_full of every pipeline stage: stage s gathers its tensors over
    TP/EP and broadcasts them over its PP group, stage after stage; one tensor at a time, or
    (bucket_bytes > 0) one bucket at a time (converters.buckets).

    The receivers need each tensor's (name, shape, dtype) first: the first sync sends them
    with the tensors and `headers` keeps each stage's list, so later syncs send only tensors
    (the list is fixed by the model and plan)."""
    from converters.buckets import iter_full_buckets

    pp = groups.size("pp")
    if pp == 1:
        if bucket_bytes > 0:
            yield from iter_full_buckets(module, groups, spec, bucket_bytes)
        else:
            yield from iter_full(module, groups, spec)
        return
    if bucket_bytes > 0:
        yield from _stages_in_buckets(module, groups, spec, headers, bucket_bytes)
        return
    device = next(module.parameters()).device
    for stage in range(pp):
        src = dist.get_global_rank(groups.pp, stage)
        if stage == groups.rank("pp"):
            sent = headers.get(stage)
            local = []
            for key, tensor in iter_full(module, groups, spec):
                if sent is None:
                    box = [(key, tuple(tensor.shape), tensor.dtype)]  # our own tuple
                    dist.broadcast_object_list(box, src=src, group=groups.pp)
                local.append((key, tuple(tensor.shape), tensor.dtype))
                dist.broadcast(tensor.contiguous(), src=src, group=groups.pp)
                yield key, tensor
            if sent is None:
                dist.broadcast_object_list([None], src=src, group=groups.pp)
            headers[stage] = local
            continue
        for key, shape, dtype in _stage_headers(headers, stage, src, groups.pp):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=src, group=groups.pp)
            yield key, tensor


def _stages_in_buckets(module, groups: ProcessGroups, spec, headers: dict, bucket_bytes: int):
    """all_stages with one broadcast per bucket: the stage's bucket packed into one buffer
    (converters.buckets.pack); the first sync sends each bucket's tensor list before it."""
    from converters.buckets import iter_buckets, layout, pack, unpack

    device = next(module.parameters()).device
    for stage in range(groups.size("pp")):
        src, key = dist.get_global_rank(groups.pp, stage), ("buckets", stage)
        if stage == groups.rank("pp"):
            sent, lists = headers.get(key), []
            for bucket in iter_buckets(module, groups, spec, bucket_bytes):
                buffer, places = pack([t for _, t in bucket])
                names = [k for k, _ in bucket]
                header = [(k, p[2], p[3]) for k, p in zip(names, places, strict=True)]
                if sent is None:
                    dist.broadcast_object_list([header], src=src, group=groups.pp)  # our tuples
                dist.broadcast(buffer, src=src, group=groups.pp)
                lists.append(header)
                yield from bucket
            if sent is None:
                dist.broadcast_object_list([None], src=src, group=groups.pp)
            headers[key] = lists
            continue
        for header in _stage_headers(headers, key, src, groups.pp):
            total, places = layout([(shape, dtype) for _, shape, dtype in header])
            buffer = torch.empty(total, dtype=torch.uint8, device=device)
            dist.broadcast(buffer, src=src, group=groups.pp)
            for (name, _, _), place in zip(header, places, strict=True):
                yield name, unpack(buffer, place)


def _stage_headers(headers: dict, key, src: int, group) -> Iterator:
    """A stage's list (of tensors, or of buckets' tensor lists): kept from an earlier sync,
    or received one entry at a time (the sender's end mark is None) and kept."""
    if key in headers:
        yield from headers[key]
        return
    received = []
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        if box[0] is None:
            break
        received.append(box[0])
        yield box[0]
    headers[key] = received


# ---- load: HF or our checkpoint into this rank's shard ----------------------------------


def load_hf(module, hf_dir: str | Path, spec: Qwen3MoeSpec, groups: ProcessGroups) -> None:
    """HF safetensors -> this rank's parameters, reading only the tensors this rank needs."""
    from converters.sharding import load_hf_sharded

    load_hf_sharded(module, HFSource(hf_dir), spec, groups)  # copy_ casts to the model's dtype


# ---- checkpoints -----------------------------------------------------------------------


def load_model(module, ckpt: Path) -> None:
    """Our torch_dist checkpoint, resharded to this rank's plan (collective)."""
    from megatron.core import dist_checkpointing

    if not (ckpt / ".metadata").is_file():
        raise CheckpointError(
            f"{ckpt} has no megatron-core checkpoint (.metadata): was the save interrupted?"
        )
    state = dist_checkpointing.load(module.sharded_state_dict(), str(ckpt))
    module.load_state_dict(state)


def weights_norm(module) -> float:
    """L2 norm of this rank's parameters, accumulated in float64 a slice at a time (no
    full-size copy): the resume log line's fingerprint of what a load left in the model."""
    total = 0.0
    for param in module.parameters():
        for part in param.detach().reshape(-1).split(1 << 24):
            total += float(part.double().square().sum())
    return total**0.5


def save_meta(root: Path, global_step: int, plan: dict[str, int], experts: str) -> None:
    """experts: the module the optimizer state belongs to (model weights load into either)."""
    body = {"format": FORMAT, "global_step": global_step, "plan": plan, "experts": experts}
    (root / META).write_text(json.dumps(body, indent=1))


def read_meta(root: Path) -> dict:
    meta_path = root / META
    if not meta_path.is_file():
        raise CheckpointError(
            f"{root} has no {META}: not an mcore_ep checkpoint (trainer.resume_mode)"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{root}: checkpoint format {meta.get('format')!r}, this engine reads {FORMAT!r}"
        )
    return meta


def check_optim_dir(root: Path) -> None:
    """Refuse optimizer state this engine does not read (before any collective load)."""
    optim = root / OPTIM_DIR
    if any(optim.glob("rank_*.pt")):
        raise CheckpointError(
            f"{optim} holds pickled per-rank optimizer files (rank_NNNNN.pt) from an older "
            "mcore_ep, which this engine does not unpickle: resume from its model weights only "
            "(checkpoint.load_contents=[model]) or export them (python -m converters mcore-to-hf)"
        )
    if (optim / "dist_ckpt").is_dir():
        check_complete([optim / "dist_ckpt"])
    if not (optim / "dist_ckpt" / ".metadata").is_file():
        raise CheckpointError(
            f"{optim} has no megatron-core optimizer checkpoint (dist_ckpt/.metadata): was the "
            "save interrupted, or saved without the optimizer (checkpoint.save_contents)?"
        )


def check_sealed(dirs: list[Path], step_dir: Path | None = None) -> None:
    """Before megatron-core unpickles anything of a checkpoint: rank 0 checks every file
    against its manifest and vets every pickle with the allow-list (converters.pickles.safe_pickle),
    and `data.pt` and the async modes' `transfer_queue/` of verl's `step_dir`, which verl
    unpickles once this load has returned
    (recipes.dapo.checkpoints.resume); a failure reaches every rank as the same one-line CheckpointError.
    Collective."""
    from converters.manifest import verify_manifest
    from converters.pickles.safe_pickle import check_dist_checkpoint
    from recipes.dapo.checkpoints.resume import check_data_state, check_queue_state_of

    problem = [None]
    if dist.get_rank() == 0:
        try:
            check_complete(dirs)
            if step_dir is not None:
                check_data_state(step_dir)
                check_queue_state_of(step_dir)  # read by verl's async modes only; vetted always
            for d in dirs:
                verify_manifest(d)
                check_dist_checkpoint(d)
        except CheckpointError as err:
            problem[0] = str(err)
    dist.broadcast_object_list(problem, src=0)  # our own string, not a user file
    if problem[0]:
        raise CheckpointError(problem[0])


def prune(saved: list[Path], keep: int | None) -> None:
    """Remove the oldest saved actor checkpoints beyond `keep` (rank 0)."""
    while keep and keep > 0 and len(saved) > keep:
        shutil.rmtree(saved.pop(0), ignore_errors=True)


def clear_for_save(root: Path) -> None:
    """Rank 0 removes what an earlier save left in `root` (a half-written one of a stopped
    run, or one this save replaces), so that no stale file mixes into its manifest.
    Collective."""
    if dist.get_rank() == 0 and root.exists():
        shutil.rmtree(root)
    dist.barrier()
