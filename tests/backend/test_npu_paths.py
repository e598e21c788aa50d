"""Ascend-only code paths exercised on CPU: the causal mask through activation recompute, and
megatron-core's torch.compile'd fused kernels run eagerly once the npu shims are applied."""

import subprocess
import sys
import textwrap

import pytest
import torch

from backend.model.build import BuildOptions, build_model
from backend.model.forward import causal_mask, forward_logits, is_causal_mask
from backend.qwen3_moe import load_qwen3_moe_spec
from recipes.local.task.hf_checkpoints import tiny_config

pytestmark = pytest.mark.mcore_compat


def test_a_detached_alias_of_the_causal_mask_is_recognised():
    mask = causal_mask(12)
    assert is_causal_mask(mask.detach())  # what recompute's replay receives
    assert not is_causal_mask(mask.clone())  # same values, other memory: not ours to trust
    assert not is_causal_mask(mask[..., :6, :6]) and not is_causal_mask(None)


def test_causal_attention_without_a_mask_through_recompute(world1, monkeypatch):
    """With full recompute the layers run twice (forward, replay in backward): both must take
    the causal kernel path, never an explicit [s, s] mask (2x the attention work on Ascend)."""
    import backend.model.attention as attention

    calls = []
    sdpa = attention.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal, torch.is_grad_enabled()))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    spec = load_qwen3_moe_spec(tiny_config())
    torch.manual_seed(0)
    model = build_model(spec, world1, BuildOptions(attention="sdpa", recompute=True))
    ids = torch.randint(0, spec.vocab_size, (2, 10))
    forward_logits(model, ids).float().square().mean().backward()
    assert len(calls) == 2 * spec.num_layers  # the forward and the replay
    assert all(no_mask and causal for no_mask, causal, _ in calls), calls
    assert any(grad for *_, grad in calls)  # the replay ran under autograd


def test_npu_shims_leave_no_torch_compile_in_megatron():
    """In a fresh process: megatron wraps weighted_swiglu in torch.compile at import; after
    apply_shims('npu') no megatron function is compile-wrapped, the weighted SwiGLU gives the
    eager values and dynamo compiles nothing."""
    script = textwrap.dedent(
        """
        import torch
        from torch._dynamo.utils import counters
        from megatron.core.fusions import fused_bias_swiglu as f
        from backend.platform.mcore_shims import apply_shims, compiled_functions

        assert "megatron.core.fusions.fused_bias_swiglu.weighted_swiglu" in compiled_functions()
        apply_shims("npu")
        import megatron.core.transformer.moe.experts  # imported after the shim: no-op fuser
        assert compiled_functions() == [], compiled_functions()
        y = torch.randn(6, 8, requires_grad=True)
        w = torch.rand(6, 1)
        out = f.weighted_bias_swiglu_impl(y, None, w)
        a, b = y.detach().chunk(2, -1)
        torch.testing.assert_close(out, torch.nn.functional.silu(a) * b * w)
        out.sum().backward()
        assert not counters["frames"] and not counters["stats"], dict(counters)
        print("eager")
        """
    )
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "eager", run.stderr[-2000:]
