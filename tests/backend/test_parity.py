"""megatron-core Qwen3-MoE vs transformers' Qwen3MoeForCausalLM on the same weights (fp32).

Both module sets: megatron-core's local ones (SequentialMLP, DotProductAttention) and ours
(GroupedExperts with the loop and the grouped_mm kernels, SDPAttention); both routings:
top-k of the softmax renormalised (norm_topk_prob, Qwen3-30B-A3B's) and not (megatron-core's
pre-softmax router, backend/qwen3_moe/megatron.py). A wrong routing branch (pre_softmax
tied to the other value of norm_topk_prob) fails the logits, log-probs and gradients."""

import pytest
import torch

from backend.model.build import BuildOptions, build_model
from backend.model.forward import forward_logits, next_token_log_probs
from backend.qwen3_moe import load_qwen3_moe_spec, unfuse_experts
from converters.hf_io import read_state_dict
from converters.sharding import expanded_parameters, load_hf_into_model
from converters.table import mcore_to_hf
from tests.support.torch_features import needs_grouped_mm

pytestmark = pytest.mark.mcore_compat
ATOL = 1e-5


MODULES = {
    "mcore-local": BuildOptions(experts="sequential", attention="local"),
    "grouped-loop-sdpa": BuildOptions(experts="grouped", attention="sdpa", grouped_gemm="loop"),
    "grouped_mm-sdpa": BuildOptions(experts="grouped", attention="sdpa", grouped_gemm="grouped_mm"),
}


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def checkpoint(request, tiny_hf_dir, tiny_hf_model, tmp_path_factory):
    """(HF dir, transformers' model) of the tiny model with norm_topk_prob on / off."""
    if request.param:
        hf_dir, model = tiny_hf_dir, tiny_hf_model
    else:
        from transformers import Qwen3MoeForCausalLM

        from recipes.local.task.hf_checkpoints import make_tiny_checkpoint

        hf_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("no_norm"), norm_topk_prob=False)
        model = Qwen3MoeForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    assert load_qwen3_moe_spec(hf_dir).norm_topk_prob is request.param
    assert model.config.norm_topk_prob is request.param
    return hf_dir, model


@pytest.fixture(scope="module")
def hf_dir(checkpoint):
    return checkpoint[0]


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return checkpoint[1]


@pytest.fixture(
    scope="module",
    params=[pytest.param(m, marks=needs_grouped_mm) if "grouped_mm" in m else m for m in MODULES],
)
def mcore_model(request, world1, hf_dir):
    spec = load_qwen3_moe_spec(hf_dir)
    model = build_model(spec, world1, MODULES[request.param])
    load_hf_into_model(model, read_state_dict(hf_dir), spec)  # per-expert keys from disk
    return model.eval()


@pytest.fixture(scope="module")
def batch():
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, 128, (3, 20), generator=generator)


def _hf_log_probs(hf_model, ids):
    logits = hf_model(ids).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


def test_logits_match_transformers(mcore_model, hf_model, batch):
    with torch.no_grad():
        ours, ref = forward_logits(mcore_model, batch), hf_model(batch).logits
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    print(f"max |logits diff| = {err:.3e}")
    assert err < ATOL


def test_log_probs_match_transformers(mcore_model, hf_model, batch):
    with torch.no_grad():
        ours, ref = next_token_log_probs(mcore_model, batch), _hf_log_probs(hf_model, batch)
    err = (ours - ref).abs().max().item()
    print(f"max |log-prob diff| = {err:.3e}")
    assert err < ATOL


def test_gradients_match_transformers(mcore_model, hf_model, batch, hf_dir):
    spec = load_qwen3_moe_spec(hf_dir)
    mcore_model.zero_grad(set_to_none=True)
    hf_model.zero_grad(set_to_none=True)
    # the same loss on both: token-mean negative log-likelihood
    (-next_token_log_probs(mcore_model, batch).mean()).backward()
    (-_hf_log_probs(hf_model, batch).mean()).backward()
    ours = mcore_to_hf({n: g for n, _, g in expanded_parameters(mcore_model, grads=True)}, spec)
    ref = unfuse_experts({n: p.grad for n, p in hf_model.named_parameters()})
    assert ours.keys() == ref.keys()
    worst = max(((ours[n] - ref[n]).abs().max().item(), n) for n in ours)
    scale = max(g.abs().max().item() for g in ref.values())
    print(f"max |grad diff| = {worst[0]:.3e} at {worst[1]} (largest grad {scale:.3e})")
    for name in ours:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    mcore_model.zero_grad(set_to_none=True)
    hf_model.zero_grad(set_to_none=True)


def test_routing_matches_transformers(mcore_model, hf_model, batch):
    """Same experts chosen per token in every layer (softmax, top-k, renormalised)."""
    from backend.instruments.router_tap import RouterTap

    chosen = {}
    tap = RouterTap(mcore_model, None)
    tap.add_listener(lambda c: chosen.__setitem__(c.layer, c.routing_map_TE))
    hf_logits = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, o: hf_logits.append(o))
        for layer in hf_model.model.layers
    ]
    try:
        with torch.no_grad():
            forward_logits(mcore_model, batch)
            hf_model(batch)
    finally:
        tap.remove()
        for h in hooks:
            h.remove()
    for layer, out in enumerate(hf_logits):
        hf_idx = out[-1]  # (logits, scores, indices [tokens (batch-major), k])
        b, s = batch.shape
        # mcore tokens are sequence-major: reorder to batch-major
        mc_map = chosen[layer].reshape(s, b, -1).transpose(0, 1).reshape(b * s, -1)
        hf_map = torch.zeros_like(mc_map).scatter(1, hf_idx.reshape(b * s, -1), True)
        assert torch.equal(mc_map, hf_map), f"layer {layer}"
