"""R3 (routing replay) across 2 gloo ranks, token for token, through verl's engine interface:
the tiny Qwen3-MoE at tp2, ep2, tp2 x ep2 and pp2, and the mini one (Qwen3-30B-A3B's routing:
128 experts, top-8) at ep2, all in one start of the ranks (tests.support.multiproc.run_plans: verl's
import, most of a start, is paid once). tests/backend/test_router_replay.py holds the method (a hook
on GPTModel names each router call's tokens) and the world-1 tests.

At the mini shape the rollout's routes put each token's 8 experts 16 ids apart, 4 on either
EP rank's half of the 128, so a replayed route reaches the experts through EP dispatch and
back; the ids reach 127, past the tiny model's 8, in vLLM's uint8 rows, handed to the routers
as uint8 (route_dtype: up to 256 experts).
"""

import pytest
import torch
from packaging.version import Version

from tests.backend.test_router_replay import (
    LAYERS,
    Watch,
    fed_router_tokens,
    r3_update_rank,
    sum_loss,
)
from tests.recipes.test_verl_engine import LENGTHS, build_engine, make_batch
from tests.support.mcore_release import MCORE_RELEASE

pytestmark = pytest.mark.slow
MINI_E, MINI_K, MINI_LAYERS = 128, 8, 4  # parallel.models.MINI_QWEN3_MOE
MINI_LAST = 31  # every row's last token (the rollout never feeds it): the vocabulary's last id
MINI_FIRST = 24  # row b starts with MINI_FIRST + b (5 rows: 24..28); other tokens are below

# tiny: (tp, ep, recompute[, pp, rollout]). pp2 without recompute: under 1F1B a backward's
# recompute follows the next forward, so Watch could not tell whose tokens it routes (the
# engine's own handling of that: tests/recipes/test_pipeline_engine.py). megatron-core 0.12.1 cannot
# run tp=2 with ep=1 and etp=1.
TINY_PLANS = [(2, 1, True), (1, 2, True), (2, 2, True), (1, 1, False, 2, "vllm")]
if MCORE_RELEASE < Version("0.13"):
    TINY_PLANS.remove((2, 1, True))
MINI_PLANS = [(2, True)]  # (ep, recompute): vLLM's uint8 routes


def mini_forced_experts(ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The mini test's rollout routes [..., 8]: ids 16 apart, offset by the token and layer."""
    base = (ids.long() + 5 * layer) % 16
    return (base[..., None] + 16 * torch.arange(MINI_K)).sort(-1).values


def mini_marked_batch(seed: int):
    """make_batch in the mini vocabulary: unique first tokens, MINI_LAST last, no other
    MINI_FIRST.. / MINI_LAST ids."""
    data = make_batch(max_tokens=16, seeds=(seed,))
    rows = []
    for b, ids in enumerate(data["input_ids"].unbind()):
        ids = ids % MINI_FIRST
        ids[0], ids[-1] = MINI_FIRST + b, MINI_LAST
        rows.append(ids)
    data["input_ids"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return data


def mini_rollout_routes(data) -> torch.Tensor:
    """vLLM's routed_experts: uint8 rows [len - 1, L, 8] (none for the token it never fed)."""
    rows = []
    for ids in data["input_ids"].unbind():
        r = torch.stack([mini_forced_experts(ids, layer) for layer in range(MINI_LAYERS)], 1)
        rows.append(r[:-1].to(torch.uint8))
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def mini_mismatches(watch: Watch) -> tuple[int, int, int]:
    """(tokens checked, tokens not on mini_forced_experts, recompute calls), real fed tokens."""
    from backend.model.router_replay import indices_to_map_TE

    checked = wrong = recomputes = 0
    for c in watch.calls:
        recomputes += c["recompute"]
        fed_T = (c["ids_T"] != MINI_LAST) & (c["valid_T"] if c["valid_T"] is not None else True)
        want_TE = indices_to_map_TE(mini_forced_experts(c["ids_T"], c["layer"]), MINI_E)
        checked += int(fed_T.sum())
        wrong += int((fed_T & ~(c["used_TE"] == want_TE).all(-1)).sum())
    return checked, wrong, recomputes


def r3_mini_rank(rank, hf_dir, ep, recompute):
    """One rank of the mini model: R3 old-log-prob pass and update on the forced routes; per
    phase the mismatch counts, and the (layers, dtype) of the routes handed to the routers."""
    import os

    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    # GroupedExperts + SDPAttention (the accelerators' modules) cost less CPU time here than
    # megatron-core's SequentialMLP, 128 expert modules run one by one (a start of 2 ranks with
    # this plan and one tiny plan: 35-40 vs 43-52 CPU-s); replay happens in the router, before
    # either
    engine = build_engine(hf_dir, ep=ep, recompute=recompute, router_replay="R3", fast=True)
    data = mini_marked_batch(seed=engine.get_data_parallel_rank())
    data["routed_experts"] = mini_rollout_routes(data)
    watch, given = Watch(engine), set()
    set_routes = engine.routing.tap.set_routes

    def seen(replay=None, reference=None):
        if replay is not None:
            given.add((replay.experts_BSLK.shape[2], replay.experts_BSLK.dtype))
        set_routes(replay=replay, reference=reference)

    engine.routing.tap.set_routes = seen
    with engine.eval_mode():
        engine.infer_batch(data)
    old = mini_mismatches(watch)
    watch.calls.clear()
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(data, sum_loss)
    return {"old_log_prob": old, "update": mini_mismatches(watch), "given": given}


def r3_rank(rank, shape, hf_dir, *plan):
    """The tiny or the mini model's rank function, so that both run in one start."""
    return (r3_update_rank if shape == "tiny" else r3_mini_rank)(rank, hf_dir, *plan)


@pytest.fixture(scope="module")
def results(tiny_hf_dir, mini_hf_dir):
    """{shape: [(plan, per-rank results)]} of every plan above, from one start of 2 ranks."""
    from tests.support.multiproc import run_plans

    plans = [("tiny", str(tiny_hf_dir), *p) for p in TINY_PLANS]
    plans += [("mini", str(mini_hf_dir), *p) for p in MINI_PLANS]
    out = {"tiny": [], "mini": []}
    for (shape, _, *plan), per_rank in zip(plans, run_plans(r3_rank, 2, plans), strict=True):
        out[shape].append((plan, per_rank))
    return out


def test_r3_under_tp_and_ep_with_recompute_routes_as_the_rollout(results):
    """2 gloo ranks: sequence-parallel slices and EP dispatch, recompute on; tp2, ep2,
    tp2 x ep2 and pp2 (vLLM's uint8 routes) in one spawn (megatron-core 0.12.1 cannot run
    tp=2 with ep=1 and etp=1). Each DP replica's ranks together check exactly the tokens it
    fed: catches a fed token the router never routes as a real one (each row's first token
    marked as padding in the micro-batch's mask), as the world-1 test does, on every plan."""
    for (tp, ep, recompute, *pp), per_rank in results["tiny"]:
        for rank, result in enumerate(per_rank):
            assert (result["update"][2] > 0) == recompute, f"tp={tp} ep={ep} rank {rank}"
            # pp=2 (uint8 routes as vLLM returns them): each stage is handed its layer only
            layers = (rank, 1) if pp else (0, LAYERS)
            assert result["given"] == {(*layers, torch.uint8)}, f"tp={tp} ep={ep} rank {rank}"
        for phase in ("old_log_prob", "update"):
            # each rank checks its sequence-parallel slice or its stage's layer: a DP
            # replica's ranks add up
            checked: dict[int, int] = {}
            for rank, result in enumerate(per_rank):
                seen, wrong, _ = result[phase]
                where = f"tp={tp} ep={ep} pp={pp[:1]} rank {rank} {phase}"
                assert wrong == 0, where
                checked[result["dp_rank"]] = checked.get(result["dp_rank"], 0) + seen
            fed = fed_router_tokens(recompute and phase == "update")
            assert checked == dict.fromkeys(checked, fed), f"tp={tp} ep={ep} {phase}: {checked}"


def test_r3_at_ep2_routes_every_fed_token_on_the_rollouts_8_of_128_experts(results):
    """The mini model at ep2 (dp2: each rank its own rows), vLLM's uint8 routes, full
    recompute: every fed token in every layer routed exactly on its 8 forced experts, in both
    passes and recompute's replays, and all 4 layers' routes handed over as uint8. Catches an
    expert id cut or wrapped on its way to the routers, a token's experts on the other EP rank
    dropped or swapped, a fed token the router never routes as a real one (fewer checked than
    fed)."""
    fed = MINI_LAYERS * sum(p + r - 1 for p, r in LENGTHS)  # every row but its last token
    for (ep, recompute), per_rank in results["mini"]:
        for rank, result in enumerate(per_rank):
            where = f"ep={ep} recompute={recompute} rank {rank}"
            assert result["given"] == {(MINI_LAYERS, torch.uint8)}, where
            assert (result["update"][2] > 0) == recompute, where
            for phase in ("old_log_prob", "update"):
                checked, wrong, _ = result[phase]
                want = fed * (2 if recompute and phase == "update" else 1)
                assert (checked, wrong) == (want, 0), f"{where} {phase}: {wrong} of {checked}"
