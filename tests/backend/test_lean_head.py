"""Lean log-prob heads (backend.model.lean_head) equal the full-logits heads: forward within 1e-6,
gradients (hidden states, output weight, every parameter) within rtol 1e-5; fp32 CPU, world 1
and tp2 (sequence parallel), temperature 1 / scalar / per row, entropy on and off."""

import pytest
import torch

from backend.model.forward import token_log_probs
from backend.model.lean_head import lean_log_probs
from recipes.dapo.engine.logprobs import vocab_parallel_entropy
from tests.support.lean_head_ranks import compare_heads, run_tp
from tests.support.multiproc import run_plans

TEMPERATURES = ["one", "scalar", "rows"]


def _assert_same(result: dict, case=None) -> None:
    """Lean head outputs and gradients equal the full head's (case: named in failures)."""
    full, lean = result["full"], result["lean"]
    assert full["out"].keys() == lean["out"].keys()
    for k in full["out"]:
        torch.testing.assert_close(lean["out"][k], full["out"][k], rtol=0, atol=1e-6)
    assert full["grads"].keys() == lean["grads"].keys()
    for name, grad in full["grads"].items():
        # atol relative to the tensor's largest entry: entries that cancel to ~0 (embedding
        # rows, through the layers) keep the absolute error of the large ones they sum
        atol = 1e-6 * float(grad.abs().max())
        torch.testing.assert_close(
            lean["grads"][name],
            grad,
            rtol=1e-5,
            atol=atol,
            msg=lambda m, n=name: f"{case} {n}: {m}",
        )


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("per_row", [False, True])
def test_function_matches_logits_path(world1, entropy, per_row):
    """lean_log_probs on raw hidden states / weight against logits = h W^T and today's heads."""
    g = torch.Generator().manual_seed(0)
    tokens, hidden, vocab = 37, 16, 50
    # logits of a few units, as a trained head gives: log-probs stay under 8, where 1e-6 is
    # a few fp32 ulps (any change of summation order moves the last bit)
    h_TH = (torch.randn(tokens, hidden, generator=g) * 0.5).requires_grad_()
    w_VH = (torch.randn(vocab, hidden, generator=g) * 0.5).requires_grad_()
    labels_T = torch.randint(0, vocab, (tokens,), generator=g)
    temp_T = torch.rand(tokens, generator=g) + 0.5 if per_row else torch.full((tokens,), 0.8)
    coef = torch.randn(2, tokens, generator=g)

    def loss_of(logp_T, entropy_T):
        return (logp_T * coef[0]).sum() + ((entropy_T * coef[1]).sum() if entropy else 0.0)

    logp_T, ent_T = lean_log_probs(h_TH, w_VH, labels_T, temp_T, entropy, chunk=5)
    lean_grads = torch.autograd.grad(loss_of(logp_T, ent_T), (h_TH, w_VH))
    logits_1TV = (h_TH @ w_VH.t() / temp_T[:, None])[None]
    ref_logp = token_log_probs(logits_1TV, labels_T[None])[0]
    ref_ent = vocab_parallel_entropy(logits_1TV)[0] if entropy else None
    ref_grads = torch.autograd.grad(loss_of(ref_logp, ref_ent), (h_TH, w_VH))
    torch.testing.assert_close(logp_T, ref_logp, rtol=0, atol=1e-6)
    if entropy:
        torch.testing.assert_close(ent_T, ref_ent, rtol=0, atol=1e-6)
    for ours, ref in zip(lean_grads, ref_grads, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_no_grad_pass_keeps_nothing(world1):
    """Under no_grad (the old-log-prob pass) the outputs hold no graph."""
    h_TH, w_VH = torch.randn(9, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    with torch.no_grad():
        logp_T, ent_T = lean_log_probs(h_TH, w_VH, torch.zeros(9, dtype=torch.long),
                                       torch.ones(9), entropy=True)  # fmt: skip
    assert logp_T.grad_fn is None and ent_T.grad_fn is None


@pytest.fixture(scope="module")
def tiny_model(world1, tiny_hf_dir):
    from backend.model.build import build_model
    from backend.qwen3_moe import load_qwen3_moe_spec
    from converters.hf_io import read_state_dict
    from converters.sharding import load_hf_sharded

    spec = load_qwen3_moe_spec(tiny_hf_dir)
    model = build_model(spec, world1)
    load_hf_sharded(model, read_state_dict(tiny_hf_dir), spec, world1)
    return model, spec.vocab_size


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_model_heads_match_world1(tiny_model, monkeypatch, temperature, entropy):
    import backend.model.lean_head as lean_head
    from tests.support.lean_head_ranks import temperatures

    monkeypatch.setattr(lean_head, "CHUNK_BYTES", lean_head.CHUNK_BYTES)  # restored after
    model, vocab = tiny_model
    _assert_same(compare_heads(model, vocab, temperatures(temperature), entropy))


TP2_CASES = [("one", False), ("rows", True), ("scalar", True)]  # (temperature, entropy)


@pytest.mark.slow
def test_model_heads_match_tp2(tiny_hf_dir):
    """tp2 with sequence parallelism (etp2: 0.12.1 needs it): each rank's vocab shard; the
    temperature / entropy cases in one spawn."""
    per_case = run_plans(run_tp, 2, TP2_CASES, str(tiny_hf_dir), 2)
    for case, results in zip(TP2_CASES, per_case, strict=True):
        for result in results:
            _assert_same(result, case)
