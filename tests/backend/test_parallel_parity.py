"""TP2, EP2, PP2 and TP2xEP2 (gloo processes) reproduce world size 1 on the same weights."""

import pytest
import torch
from packaging.version import Version

from backend.model.build import build_model
from backend.model.forward import forward_logits, token_log_probs
from backend.qwen3_moe import load_qwen3_moe_spec
from converters.hf_io import read_state_dict
from converters.sharding import load_hf_into_model
from tests.support.mcore_release import MCORE_RELEASE
from tests.support.multiproc import run_plans, run_ranks
from tests.support.parallel_ranks import BATCH, SEQ, global_batch, run_plan

pytestmark = [pytest.mark.slow, pytest.mark.mcore_compat]


@pytest.fixture(scope="module")
def reference(world1, tiny_hf_dir):
    spec = load_qwen3_moe_spec(tiny_hf_dir)
    model = build_model(spec, world1)
    load_hf_into_model(model, read_state_dict(tiny_hf_dir), spec)
    ids = global_batch(spec.vocab_size)
    logits = forward_logits(model, ids)
    loss = -token_log_probs(logits[:, :-1], ids[:, 1:]).sum() / (BATCH * (SEQ - 1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), logits.detach(), grads


# (tp, ep, pp, etp, fast, untagged_norms) per plan; each world's plans run in one spawn of its
# ranks (tests.support.multiproc.run_plans). tp2xep2 on 4 ranks: attention tp2 x dp2, experts ep2 x edp2
# (MoE parallel folding). "fast": GroupedExperts + SDPAttention against the same world-1
# reference. "untagged-norms": norms that do not tag their weights sequence_parallel (a device's
# own, as on Ascend): build_model tags them, so their gradients still sum over TP. It patches
# megatron-core's norm class for the rest of the process, so it runs last.
WORLD2 = {
    "tp2": (2, 1, 1, 1, False, False),
    "tp2-etp2": (2, 1, 1, 2, False, False),
    "ep2": (1, 2, 1, 1, False, False),
    "pp2": (1, 1, 2, 1, False, False),
    "fast-tp2-etp2": (2, 1, 1, 2, True, False),
    "fast-ep2": (1, 2, 1, 1, True, False),
    "untagged-norms": (2, 1, 1, 2, True, True),
}
WORLD4 = {"tp2xep2": (2, 2, 1, 1, False, False), "fast-tp2xep2": (2, 2, 1, 1, True, False)}
TP_ALONE_REFUSED = MCORE_RELEASE < Version("0.13")  # tp=2 with ep=1 and etp=1


@pytest.mark.parametrize("world, plans", [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"])
def test_plans_match_world1(reference, tiny_hf_dir, world, plans):
    if TP_ALONE_REFUSED:
        plans = {name: plan for name, plan in plans.items() if name != "tp2"}
    results = run_plans(run_plan, world, list(plans.values()), str(tiny_hf_dir))
    for name, per_rank in zip(plans, results, strict=True):
        _matches(per_rank, reference, name)


@pytest.mark.skipif(not TP_ALONE_REFUSED, reason="megatron-core >= 0.13 runs tp2 (above)")
def test_tp2_without_ep_is_refused_before_0_13(tiny_hf_dir):
    with pytest.raises(AssertionError, match="cannot run tp=2 with ep=1 and etp=1"):
        run_ranks(run_plan, 2, str(tiny_hf_dir), *WORLD2["tp2"])


def _matches(results, reference, plan: str):
    ref_loss, ref_logits, ref_grads = reference
    last = [r for r in results if r["last_stage"]]
    by_dp = {r["dp_rank"]: r["logits"] for r in last}  # TP peers hold the same rows
    logits = torch.cat([by_dp[d] for d in sorted(by_dp)])
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5, msg=_named(plan))
    torch.testing.assert_close(last[0]["loss"], ref_loss, rtol=0, atol=1e-6, msg=_named(plan))
    grads = results[0]["grads"]
    assert grads.keys() == ref_grads.keys(), plan
    for name, ref in ref_grads.items():
        torch.testing.assert_close(
            grads[name], ref, rtol=1e-4, atol=1e-6, msg=_named(f"{plan}: {name}")
        )


def _named(what: str):
    return lambda message: f"{what}: {message}"
