"""The rollout weight stream in buckets (converters.buckets, mcore_ep.weight_sync_bucket_mb) on
2 gloo ranks at tp2 (etp2, and etp1 on 0.16.1), ep2 and pp2: the same HF names in the same order with the same bytes
(sha256) as the per-tensor stream on every rank, and exactly the collectives the sync's cost
model (parallel.weight_sync) counts for that plan, on the first sync and the next."""

import hashlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from tests.support.multiproc import loaded_model, run_plans

pytestmark = [pytest.mark.slow, pytest.mark.mcore_compat]
BUCKET_BYTES = 48 << 10  # several buckets of the tiny model's 0.6 MB
COUNTED = ("all_gather", "broadcast", "broadcast_object_list")


class CountCollectives:
    """Counts torch.distributed calls by name while installed (our code looks them up on
    the module at each call)."""

    def __init__(self):
        self.calls, self._saved = Counter(), {}

    def __enter__(self):
        for name in COUNTED:
            real = self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._counted(name, real))
        return self

    def _counted(self, name, real):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return real(*args, **kwargs)

        return call

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)


def _checksums(stream) -> list[tuple[str, str, str, tuple]]:
    out = []
    for name, tensor in stream:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        digest = hashlib.sha256(raw.numpy()).hexdigest()
        out.append((name, digest, str(tensor.dtype), tuple(tensor.shape)))
    return out


def sync_rank(rank: int, hf_dir: str, tp: int, ep: int, pp: int, etp: int) -> dict:
    from backend.model.build import BuildOptions
    from backend.platform.device import prepare_device
    from recipes.dapo.engine.weights import hf_tensors

    prepare_device("cpu")
    opts = BuildOptions(experts="grouped", attention="sdpa")  # the accelerators' modules
    model, spec, groups = loaded_model(hf_dir, opts, tp=tp, ep=ep, pp=pp, etp=etp)
    reference = _checksums(hf_tensors(model, groups, spec, {}, bucket_bytes=0))
    headers, counts = {}, []
    for _ in range(2):  # the first sync (tensor lists sent over PP) and a later one
        with CountCollectives() as counter:
            bucketed = _checksums(hf_tensors(model, groups, spec, headers, BUCKET_BYTES))
        counts.append(dict(counter.calls))
    with CountCollectives() as counter:
        list(hf_tensors(model, groups, spec, {}, bucket_bytes=0))
    return dict(reference=reference, bucketed=bucketed, counts=counts,
                per_tensor=dict(counter.calls))  # fmt: skip


def _model_counts(hf_dir, plan: tuple, bucket_bytes: int):
    from parallel.models import load_spec
    from parallel.plan import ParallelPlan
    from parallel.weight_sync import LINKS, sync_cost

    tp, ep, pp, etp = plan
    plan = ParallelPlan(nodes=1, devices_per_node=2, tp=tp, ep=ep, pp=pp, etp=etp)
    spec = load_spec(str(hf_dir))
    fp32 = 4  # the CPU model's parameters
    return [sync_cost(spec, plan, bucket_bytes, LINKS["cuda"], r, fp32) for r in range(2)]


def plans() -> list[tuple[int, int, int, int]]:
    """(tp, ep, pp, etp): tp2 with the experts split over expert-TP too (etp2: an ETP gather),
    ep2, pp2, and tp2 with whole experts (etp1), which megatron-core 0.12.1 cannot run."""
    from packaging.version import Version

    from backend.platform.compat import mcore_version

    runs = [(2, 1, 1, 2), (1, 2, 1, 1), (1, 1, 2, 1)]
    return runs + ([(2, 1, 1, 1)] if mcore_version() >= Version("0.13") else [])


def test_buckets_stream_the_per_tensor_bytes_with_the_models_collectives(tiny_hf_dir):
    runs = plans()
    results = run_plans(sync_rank, 2, runs, str(tiny_hf_dir))
    for plan, ranks in zip(runs, results, strict=True):
        costs = _model_counts(tiny_hf_dir, plan, BUCKET_BYTES)
        per_tensor = _model_counts(tiny_hf_dir, plan, 0)
        for rank, out in enumerate(ranks):
            where = "tp{} ep{} pp{} etp{} rank ".format(*plan) + str(rank)
            assert out["bucketed"] == out["reference"], where  # names, order, bytes
            assert out["reference"] == ranks[0]["reference"], where  # every rank: the whole model
            first, later = (sum(c.values()) for c in out["counts"])
            cost = costs[rank]
            assert cost.buckets > 1, where
            assert later == cost.collectives and first == later + cost.first_sync_extra, where
            if plan[2] == 1:  # the per-tensor stream against the model's per-tensor count
                assert sum(out["per_tensor"].values()) == per_tensor[rank].collectives, where
                fewer = cost.collectives < per_tensor[rank].collectives
                assert fewer if plan[1] > 1 else cost.collectives <= per_tensor[rank].collectives
