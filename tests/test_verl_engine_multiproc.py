"""The mcore_ep engine at tp=2 and at ep=2 x dp=2 (2 gloo processes) against world size 1:
the same log-probs, the same gradient norm under verl's DAPO loss, and the same HF weights
streamed for rollout sync (gathered over TP and EP)."""

import os

import pytest
import torch
from packaging.version import Version

from backend.compat import mcore_version
from tests.multiproc import run_ranks

pytestmark = pytest.mark.slow


# (prompt, response) tokens per sequence of DP replica 0 and 1
REPLICA_LENGTHS = [
    [(5, 7), (3, 4), (6, 9), (4, 2), (2, 6)],
    [(7, 9), (3, 3), (6, 12), (4, 2), (2, 5)],
]


def engine_rank(rank: int, hf_dir: str, tp: int, ep: int) -> dict:
    """One rank: infer, compare the streamed HF weights, one DAPO train step."""
    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    from backend.device import prepare_device

    prepare_device("cpu")
    from functools import partial

    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import response_from_nested

    from backend.qwen3_moe import unfuse_experts
    from converters.hf_io import read_state_dict
    from tests import test_verl_engine as t

    engine = t.build_engine(hf_dir, tp=tp, ep=ep)
    dp_rank = engine.get_data_parallel_rank()
    # each DP replica its own rows and lengths: EP peers' micro-batches differ in shape
    data = t.make_batch(seeds=(dp_rank,), lengths=(REPLICA_LENGTHS[dp_rank],))
    with engine.eval_mode():
        log_probs = engine.infer_batch(data)["model_output"]["log_probs"]
    data["old_log_probs"] = response_from_nested(log_probs, data["response_mask"])
    hf = unfuse_experts(read_state_dict(hf_dir))
    streamed = dict(engine.get_per_tensor_param()[0])
    same_weights = streamed.keys() == hf.keys() and all(torch.equal(streamed[k], hf[k]) for k in hf)
    with engine.train_mode():
        out = engine.train_batch(
            data, loss_function=partial(ppo_loss, config=t.dapo_actor_config())
        )
    return {
        "dp_rank": dp_rank,
        "log_probs": [x.clone() for x in log_probs.unbind()],
        "same_weights": same_weights,
        "grad_norm": out["metrics"].get("grad_norm"),  # reported on tp rank 0 only
        "timing": {k: v for k, v in out["metrics"].items() if k.startswith("timing/")},
        # after the step: every replica of every weight must hold the same update
        "updated": {k: v.clone() for k, v in engine.get_per_tensor_param()[0]},
    }


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_parallel_engine_matches_world1(tp, ep, world1, tiny_hf_dir, monkeypatch):
    if mcore_version() < Version("0.13") and (tp, ep) == (2, 1):  # the engine's etp is 1
        with pytest.raises(AssertionError, match="cannot run tp=2 with ep=1 and etp=1"):
            run_ranks(engine_rank, 2, str(tiny_hf_dir), tp, ep)
        return
    results = run_ranks(engine_rank, 2, str(tiny_hf_dir), tp, ep)
    dp = max(r["dp_rank"] for r in results) + 1
    from functools import partial

    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import response_from_nested

    from tests.test_verl_engine import build_engine, dapo_actor_config, make_batch

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    engine = build_engine(tiny_hf_dir)
    data = make_batch(seeds=tuple(range(dp)), lengths=REPLICA_LENGTHS[:dp])
    with engine.eval_mode():
        ref_lp = engine.infer_batch(data)["model_output"]["log_probs"].unbind()
    data["old_log_probs"] = response_from_nested(
        torch.nested.as_nested_tensor(list(ref_lp), layout=torch.jagged), data["response_mask"]
    )
    with engine.train_mode():
        ref = engine.train_batch(data, loss_function=partial(ppo_loss, config=dapo_actor_config()))
    assert all(r["grad_norm"] is not None for r in results) == (tp == 1)
    rows_per_rank = len(ref_lp) // dp
    # replicas drift apart when a gradient misses the reduction over its replicas
    # (tp2/etp1/ep1 experts before backend.model.tag_expert_replicas)
    first = results[0]["updated"]
    for rank, r in enumerate(results[1:], start=1):
        drifted = [k for k, v in r["updated"].items() if not torch.equal(v, first[k])]
        assert not drifted, (
            f"rank {rank} holds other weights than rank 0 after the step: {drifted[:4]}"
        )
    # timing/* are the maximum over ranks: every rank reports the same figures
    assert results[0]["timing"]["timing/step_s"][0] > 0
    assert all(r["timing"] == results[0]["timing"] for r in results)
    for r in results:
        assert r["same_weights"], f"rank {r} streamed other weights than the HF checkpoint"
        if r["grad_norm"] is not None:
            assert r["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
        mine = ref_lp[r["dp_rank"] * rows_per_rank : (r["dp_rank"] + 1) * rows_per_rank]
        for a, b in zip(r["log_probs"], mine, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


OLD_LOG_PROB_COUNTS = {
    "mode": "on",
    "type": "global_batch",
    "coeff": 1e-2,
    "global_counts": "old_log_prob",
}


def old_log_prob_counts_rank(rank: int, hf_dir: str, tp: int, ep: int) -> dict:
    """One rank's aux-loss f counts after the old-log-prob pass over its DP shard."""
    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    from backend.device import prepare_device

    prepare_device("cpu")
    from tests import test_verl_engine as t

    engine = t.build_engine(hf_dir, tp=tp, ep=ep, aux_loss=OLD_LOG_PROB_COUNTS)
    data = t.make_batch(seeds=(engine.get_data_parallel_rank(),))
    with engine.eval_mode():
        engine.infer_batch(data)
    return {"counts": [c.clone() for c in engine.routing.hook.step_counts]}


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_old_log_prob_counts_sum_over_ranks(tp, ep, world1, tiny_hf_dir, monkeypatch):
    """The old-log-prob pass's counts, summed over ranks (TP slices, DP replicas), are world
    size 1's over the whole batch: every rank holds the same global f."""
    if mcore_version() < Version("0.13") and (tp, ep) == (2, 1):
        pytest.skip("megatron-core < 0.13 cannot run tp=2 with ep=1 and etp=1")
    results = run_ranks(old_log_prob_counts_rank, 2, str(tiny_hf_dir), tp, ep)
    from tests.test_verl_engine import build_engine, make_batch

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    engine = build_engine(tiny_hf_dir, aux_loss=OLD_LOG_PROB_COUNTS)
    dp = 2 if ep == 2 else 1
    with engine.eval_mode():
        engine.infer_batch(make_batch(seeds=tuple(range(dp))))
    for r in results:
        for mine, ref in zip(r["counts"], engine.routing.hook.step_counts, strict=True):
            assert torch.equal(mine, ref)
