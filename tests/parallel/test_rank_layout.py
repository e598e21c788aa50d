"""The pure-Python rank layout against megatron-core's own groups."""

from itertools import product

import pytest

from parallel.plan import ParallelPlan, PlanError
from parallel.rank_layout import GROUP_NAMES, RankLayout
from tests.support.multiproc import job_plan, run_ranks

# (tp, pp, cp, ep, etp) run inside one spawn per world size
PLANS_8 = [
    (2, 1, 1, 4, 1),
    (2, 2, 1, 2, 1),
    (4, 1, 1, 2, 1),
    (2, 1, 2, 2, 1),
    (1, 2, 1, 4, 1),
    (2, 1, 1, 2, 2),
    (1, 2, 2, 2, 2),
]
PLANS_4 = [(2, 1, 1, 2, 1), (1, 2, 1, 2, 1)]
# ProcessGroups field -> layout group
FIELDS = {"tp": "tp", "pp": "pp", "cp": "cp", "dp": "dp", "ep": "ep", "etp": "etp", "edp": "edp"}


def _plan(world: int, tp: int, pp: int, cp: int, ep: int, etp: int) -> ParallelPlan:
    return ParallelPlan(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, nodes=1, devices_per_node=world)


def test_layout_matches_megatron_rank_generator():
    """Many plans and orders, no processes: megatron-core's RankGenerator is the reference."""
    from megatron.core.parallel_state import RankGenerator

    checked = 0
    for world, tp, cp, pp, ep, etp, order in product(
        (8, 16, 64),
        (1, 2, 4),
        (1, 2),
        (1, 2, 4),
        (1, 2, 8),
        (1, 2),
        ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-cp-ep-dp"),
    ):
        try:
            plan = ParallelPlan(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, nodes=world // 8)
            layout = RankLayout(plan, order)
        except PlanError:
            continue
        attention = RankGenerator(tp=tp, ep=1, dp=plan.dp, pp=pp, cp=cp, order=order)
        expert = RankGenerator(tp=etp, ep=ep, dp=plan.edp, pp=pp, cp=1, order=order)
        for name, gen, token in (
            ("tp", attention, "tp"),
            ("cp", attention, "cp"),
            ("dp", attention, "dp"),
            ("pp", attention, "pp"),
            ("ep", expert, "ep"),
            ("etp", expert, "tp"),
            ("edp", expert, "dp"),
        ):
            assert layout.groups(name) == sorted(map(tuple, gen.get_ranks(token))), (
                plan,
                order,
                name,
            )
        checked += 1
    assert checked > 300


def test_orders_that_split_pp_groups_are_refused():
    plan = ParallelPlan(tp=2, pp=2, ep=4, nodes=1)  # attention pp stride 2*2, expert 4
    with pytest.raises(PlanError, match="different pp groups"):
        RankLayout(plan, "tp-cp-ep-pp-dp")


def test_coords_and_groups_agree():
    layout = RankLayout(ParallelPlan(tp=2, pp=2, cp=2, ep=4, nodes=2))
    for rank in range(layout.plan.world):
        c = layout.coords(rank)
        assert c.node == rank // 8
        for name in GROUP_NAMES:
            group = layout.group(rank, name)
            assert rank in group and group[getattr(c, name)] == rank


def _megatron_groups(rank: int, world: int, plans: list) -> list[dict]:
    """In one rank: initialise megatron-core for each plan in turn, report group members."""
    import torch.distributed as dist

    from backend.platform.device import prepare_device
    from backend.training.distributed import init_parallel

    prepare_device("cpu")
    from megatron.core import parallel_state as ps

    found = []
    for tp, pp, cp, ep, etp in plans:
        groups = init_parallel("cpu", job_plan(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp))
        found.append({f: tuple(dist.get_process_group_ranks(getattr(groups, f))) for f in FIELDS})
        ps.destroy_model_parallel()  # keep the world process group for the next plan
    dist.destroy_process_group()
    return found


def _fake_world_groups(_rank: int, world: int, plans: list) -> list[list[dict]]:
    """In one process: every rank of `world` in turn on torch's fake process group (no peers,
    collectives are no-ops), megatron-core initialised for each plan; returns [rank][plan]."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from backend.platform.device import prepare_device

    prepare_device("cpu")
    from megatron.core import parallel_state as ps

    # megatron-core also builds gloo subgroups, which need real peers: on the fake world,
    # every subgroup takes the fake backend (membership, the thing compared, is unchanged)
    real_new_group = dist.new_group
    dist.new_group = lambda *args, backend=None, **kwargs: real_new_group(*args, **kwargs)
    per_rank = []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        per_rank.append(_megatron_groups(rank, world, plans))  # destroys the process group
    dist.new_group = real_new_group
    assert not ps.model_parallel_is_initialized()
    return per_rank


def _check_against_layout(world: int, plans: list, per_rank: list) -> None:
    for i, dims in enumerate(plans):
        layout = RankLayout(_plan(world, *dims))
        for rank, found in enumerate(per_rank):
            predicted = {f: layout.group(rank, g) for f, g in FIELDS.items()}
            assert found[i] == predicted, (dims, rank)


@pytest.mark.mcore_compat
def test_layout_matches_megatron_process_groups_on_a_fake_world_of_8():
    """The 8-rank plans: megatron-core's groups for each rank, computed on a fake world in one
    spawned process (the session's world-of-one process group must stay untouched)."""
    (per_rank,) = run_ranks(_fake_world_groups, 1, 8, PLANS_8)
    assert len(per_rank) == 8
    _check_against_layout(8, PLANS_8, per_rank)


@pytest.mark.slow
@pytest.mark.mcore_compat
def test_layout_matches_megatron_process_groups_on_4_real_ranks():
    """Real gloo ranks, each asking its own process groups: what the fake world cannot show
    (ranks that rendezvous and agree on every group they create together)."""
    _check_against_layout(4, PLANS_4, run_ranks(_megatron_groups, 4, 4, PLANS_4))
