"""Run a test function on N local gloo ranks (separate processes) and collect results.

Each rank is a new process forked from one forkserver per session that imported torch and
megatron-core once (PRELOAD): a rank starts in well under a second instead of re-importing
them (~8 s a spawn of 2 ranks, ~15 s of 4 on 2 cores), and still holds nothing of the test
process or an earlier test (the server runs nothing but those imports)."""

import io
import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
           "backend.model.build", "backend.training.distributed", "converters.sharding"]  # fmt: skip
_CONTEXT = None


def _context():
    """The forkserver context, its server started on first use with PRELOAD imported."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _child(rank: int, world: int, port: int, env: dict, fn, args, queue) -> None:
    # the test process's environment now (the server's is the one it started with)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    try:
        # plain bytes: tensors shared by file descriptor die with the child process
        buffer = io.BytesIO()
        torch.save(fn(rank, *args), buffer)
        queue.put((rank, buffer.getvalue(), None))
    except BaseException:  # report, then let the parent fail the test
        queue.put((rank, None, traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 300.0) -> list:
    """fn(rank, *args) on `world` processes; returns the per-rank results in rank order.

    fn must be a module-level function (the forkserver pickles it by name) and must itself
    call backend.platform.device.prepare_device and init_parallel.
    """
    ctx = _context()
    queue = ctx.Queue()
    port, env = _free_port(), dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(r, world, port, env, fn, args, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, value, err = queue.get(timeout=timeout)
            results[rank] = None if err else torch.load(io.BytesIO(value), weights_only=False)
            if err:
                errors.append(f"rank {rank}:\n{err}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def _each_plan(rank: int, fn, plans: list, args: tuple) -> list:
    """fn(rank, *args, *plan) for each plan in turn in one process; megatron-core's groups are
    torn down between plans (the world process group stays for the next)."""
    from megatron.core import parallel_state as ps

    results = []
    for plan in plans:
        results.append(fn(rank, *args, *plan))
        ps.destroy_model_parallel()
    return results


def run_plans(fn, world: int, plans: list, *args, timeout: float = 300.0) -> list:
    """One spawn of `world` ranks for several parallel plans (tuples appended to fn's args):
    [plan][rank] results. Cheaper than a start per plan: the processes start, import what
    PRELOAD does not (verl, the test's modules), and join the world once."""
    per_rank = run_ranks(_each_plan, world, fn, list(plans), args, timeout=timeout)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(plans))]


def job_plan(**dims: int):
    """The ParallelPlan of these sizes over this job's ranks (init_parallel's argument)."""
    from backend.training.distributed import job_world
    from parallel.plan import ParallelPlan

    return ParallelPlan.for_world(job_world(), **dims)


def loaded_model(hf_dir: str, opts=None, **dims: int):
    """(model, spec, groups): this rank's shard of the HF checkpoint's model at the plan of
    `dims` over this job's ranks (call prepare_device first)."""
    from backend.model.build import build_model
    from backend.qwen3_moe import load_qwen3_moe_spec
    from backend.training.distributed import init_parallel
    from converters.hf_io import read_state_dict
    from converters.sharding import load_hf_sharded

    groups = init_parallel("cpu", job_plan(**dims))
    spec = load_qwen3_moe_spec(hf_dir)
    model = build_model(spec, groups, opts)
    load_hf_sharded(model, read_state_dict(hf_dir), spec, groups)
    return model, spec, groups
