"""TP2, EP2, PP2 and TP2xEP2 (gloo processes) reproduce world size 1 on the same weights."""

import pytest
import torch
from packaging.version import Version

from backend.compat import mcore_version
from backend.forward import forward_logits, token_log_probs
from backend.model import build_model
from backend.qwen3_moe import load_qwen3_moe_spec
from converters.hf_io import read_state_dict
from converters.table import load_hf_into_model
from tests.multiproc import run_ranks
from tests.parallel_ranks import BATCH, SEQ, global_batch, run_plan

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


@pytest.mark.parametrize(
    "world, tp, ep, pp, etp, fast",
    # tp2xep2 on 4 ranks: attention tp2 x dp2, experts ep2 x edp2 (MoE parallel folding);
    # "fast": GroupedExperts + SDPAttention against the same world-1 reference
    [
        (2, 2, 1, 1, 1, False),
        (2, 2, 1, 1, 2, False),
        (2, 1, 2, 1, 1, False),
        (2, 1, 1, 2, 1, False),
        (4, 2, 2, 1, 1, False),
        (2, 2, 1, 1, 2, True),
        (2, 1, 2, 1, 1, True),
        (4, 2, 2, 1, 1, True),
    ],
    ids=["tp2", "tp2-etp2", "ep2", "pp2", "tp2xep2", "fast-tp2-etp2", "fast-ep2", "fast-tp2xep2"],
)
def test_plan_matches_world1(reference, tiny_hf_dir, world, tp, ep, pp, etp, fast):
    if mcore_version() < Version("0.13") and (tp, ep, etp) == (2, 1, 1):
        with pytest.raises(AssertionError, match="cannot run tp=2 with ep=1 and etp=1"):
            run_ranks(run_plan, world, str(tiny_hf_dir), tp, ep, pp, etp)
        return
    results = run_ranks(run_plan, world, str(tiny_hf_dir), tp, ep, pp, etp, fast)
    _matches(results, reference)


def test_norms_built_without_tags_still_sum_over_tp(reference, tiny_hf_dir):
    """Norms that do not tag their weights sequence_parallel (a device's own, as on Ascend):
    build_model tags them, so their gradients still sum over TP and match world 1."""
    _matches(run_ranks(run_plan, 2, str(tiny_hf_dir), 2, 1, 1, 2, True, True), reference)


def _matches(results, reference):
    ref_loss, ref_logits, ref_grads = reference
    last = [r for r in results if r["last_stage"]]
    by_dp = {r["dp_rank"]: r["logits"] for r in last}  # TP peers hold the same rows
    logits = torch.cat([by_dp[d] for d in sorted(by_dp)])
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(last[0]["loss"], ref_loss, rtol=0, atol=1e-6)
    grads = results[0]["grads"]
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=name)
