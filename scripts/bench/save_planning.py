"""Save planning of the model checkpoint at the full shape, for one rank, on CPU: uncached vs
cached (recipes.dapo.checkpoints.save_plans).

How, without the cluster: every rank's model is built on meta tensors (no memory, no data)
in torch's `fake` process-group backend joined as that rank (world = the plan's, e.g. 32
for tp 4 x ep 8 x dp 8), so its sharded state dict is the one that rank really has
(megatron-core's own sharded_state_dict of our GPTModel, local spec, grouped experts). Then,
timed for rank 0, what a save plans before its first byte is written:
- uncached (a new strategy: the first save, or another structure): rank 0's sharded state
  dict; megatron-core's sharding check over every rank's shard metadata
  (validate_sharding_integrity, run by rank 0 after the gather); torch DCP's local plan of
  rank 0 and the coordinator's global plan over every rank's local plan (create_global_plan);
- cached (the same structure as the last save): rank 0's sharded state dict, its
  structure_fingerprint, and torch DCP's local plan set-up on the cached plan.
The two gathers the uncached save makes are reported as bytes (the pickled metadata every
rank sends), not timed: a fake process group moves nothing. The optimizer state's directory
(megatron-core's distributed optimizer, which needs real buffers) is not built here.

    python -m scripts.bench.save_planning                  # Qwen3-30B-A3B, tp 4, ep 8, 32 ranks
    python -m scripts.bench.save_planning --tp 2 --ep 2 --world 4 --model tiny
"""

import argparse
import json
import pickle
import statistics
import sys
import time
from pathlib import Path


def join_as(rank: int, world: int, tp: int, ep: int, etp: int = 1) -> None:
    """This process as `rank` of a fake world, megatron-core's groups built for the plan."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp,
                                 create_gloo_process_groups=False)  # fmt: skip


def meta_model(spec):
    import torch

    from backend.model.build import BuildOptions, build_model
    from backend.training.distributed import current_groups

    opts = BuildOptions(device="cpu", dtype=torch.bfloat16, spec="local", experts="grouped",
                        attention="sdpa", init_weights=False)  # fmt: skip
    with torch.device("meta"):
        return build_model(spec, current_groups(), opts)


def rank_plan(model) -> tuple[list, object, float, float]:
    """(shard metadata, torch DCP's local plan, seconds of planner set-up, seconds to plan)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    part, _ = save_preprocess(model.sharded_state_dict(), validate_access_integrity=False)
    metadata = [v.without_data() for v in nested_values(part)]
    start = time.perf_counter()
    planner, _ = local_planner(part)
    set_up_s, start = time.perf_counter() - start, time.perf_counter()
    plan = planner.create_local_plan()
    return metadata, plan, set_up_s, time.perf_counter() - start


def local_planner(part: dict):
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(part, True)
    planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
    planner.set_up_planner(mcore_to_pyt_state_dict(flat, False), is_coordinator=True)
    return planner, flat


def measure(args) -> dict:
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.validation import validate_sharding_integrity

    from parallel.models import TINY_QWEN3_MOE, load_spec
    from recipes.dapo.checkpoints.save_plans import structure_fingerprint

    spec = load_spec(None) if args.model == "full" else _tiny_spec(TINY_QWEN3_MOE)
    metadata, plans, build_s = [None] * args.world, [None] * args.world, 0.0
    for rank in reversed(range(args.world)):  # rank 0 last: its model stays for the timing
        join_as(rank, args.world, args.tp, args.ep, args.etp)
        start = time.perf_counter()
        model = meta_model(spec)
        build_s = time.perf_counter() - start
        metadata[rank], plans[rank], set_up_s, local_plan_s = rank_plan(model)
        print(f"rank {rank}: built in {build_s:.1f} s, planner set-up {set_up_s:.1f} s, "
              f"local plan {local_plan_s:.2f} s", file=sys.stderr, flush=True)  # fmt: skip
    uncached, cached = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        sharded = model.sharded_state_dict()
        sharded_s = time.perf_counter() - start
        start = time.perf_counter()
        validate_sharding_integrity(metadata)
        check_s = time.perf_counter() - start
        _, _, set_up_s, local_plan_s = rank_plan(model)
        planner, _ = local_planner(save_preprocess(model.sharded_state_dict(), False)[0])
        start = time.perf_counter()
        planner.create_global_plan(plans)
        global_s = time.perf_counter() - start
        uncached.append(sharded_s + check_s + set_up_s + local_plan_s + global_s)
        start = time.perf_counter()
        sharded = model.sharded_state_dict()
        structure_fingerprint(sharded)
        part, _ = save_preprocess(sharded, validate_access_integrity=False)
        local_planner(part)  # the cached plan replaces create_local_plan / the global plan
        cached.append(time.perf_counter() - start)
    parts = dict(sharded_state_dict_s=sharded_s, sharding_check_s=check_s,
                 planner_set_up_s=set_up_s, local_plan_s=local_plan_s,
                 global_plan_s=global_s)  # fmt: skip
    return {
        "settings": dict(vars(args)),
        "rank0_entries": len(metadata[0]),
        "all_ranks_entries": sum(len(m) for m in metadata),
        "meta_build_s": build_s,
        "uncached_s": statistics.median(uncached),
        "uncached_parts_s": parts,
        "cached_s": statistics.median(cached),
        "ratio": statistics.median(cached) / statistics.median(uncached),
        "gathered_bytes": {  # what the uncached save's two gathers move (to every rank / to 0)
            "shard_metadata": sum(len(pickle.dumps(m)) for m in metadata),
            "local_plans": sum(len(pickle.dumps(p)) for p in plans),
        },
    }


def _tiny_spec(config: dict):
    import json as _json
    import tempfile

    from parallel.models import load_spec

    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(_json.dumps({"model_type": "qwen3_moe", **config}))
    return load_spec(str(path))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("full", "tiny"), default="full",
                        help="full: Qwen3-30B-A3B; tiny: the CPU run's model")  # fmt: skip
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--etp", type=int, default=1)
    parser.add_argument("--world", type=int, default=32, help="ranks (tp x dp = etp x ep x edp)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    doc = measure(args)
    doc["settings"]["out"] = str(args.out) if args.out else None
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
