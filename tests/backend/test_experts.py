"""Grouped-GEMM experts and SDPA attention against megatron-core's SequentialMLP and
DotProductAttention (fp32, world size 1): kernels, modules, checkpoint interchange, errors."""

import pytest
import torch
import torch.nn.functional as F

from backend.model.build import BuildOptions, build_model
from backend.model.grouped_gemm import grouped_linear, resolve_impl
from backend.qwen3_moe import load_qwen3_moe_spec
from converters.sharding import expanded_parameters
from recipes.local.task.hf_checkpoints import tiny_config
from tests.support.torch_features import needs_grouped_mm

pytestmark = pytest.mark.mcore_compat

SEQUENTIAL = BuildOptions(experts="sequential", attention="local")
FAST = BuildOptions(experts="grouped", attention="sdpa")


def _reference_grouped(x_TK, w_ENK, counts):
    return torch.cat([x @ w_ENK[e].t() for e, x in enumerate(x_TK.split(counts))])


@pytest.mark.parametrize("impl", ["loop", pytest.param("grouped_mm", marks=needs_grouped_mm)])
def test_grouped_linear_matches_per_expert_matmuls(impl):
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1]  # an expert without tokens still gets a (zero) weight gradient
    x = torch.randn(sum(counts), 16, generator=gen, requires_grad=True)
    w = torch.randn(4, 24, 16, generator=gen, requires_grad=True)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = grouped_linear(x, w, torch.tensor(counts), impl)
    y_ref = _reference_grouped(x_ref, w_ref, counts)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    y.sum().backward()  # a broadcast gradient: the grouped_mm path must make it contiguous
    y_ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(w.grad[1]) == 0


@pytest.mark.parametrize("impl", ["loop", pytest.param("grouped_mm", marks=needs_grouped_mm)])
def test_grouped_linear_without_tokens_gives_zero_weight_grads(impl):
    x = torch.zeros(0, 16, requires_grad=True)
    w = torch.randn(4, 24, 16, requires_grad=True)
    y = grouped_linear(x, w, torch.zeros(4, dtype=torch.long), impl)
    assert y.shape == (0, 24)
    y.sum().backward()  # the weights still get a (zero) gradient: DDP expects one
    assert w.grad is not None and torch.count_nonzero(w.grad) == 0


def test_grouped_gemm_choice(monkeypatch):
    """On CPU, auto takes torch's grouped GEMM where it runs (the SFT warm-up's step 8% faster
    at 128 experts) and the per-expert loop where it does not (the npu sets' older torch)."""
    import backend.model.grouped_gemm as gg

    cpu_kernel = torch.__version__ >= "2.13"  # TorchVersion compares as a version
    assert gg.cpu_grouped_mm_runs(torch.float32) is cpu_kernel
    assert resolve_impl("auto", torch.zeros(2, 2)) == ("grouped_mm" if cpu_kernel else "loop")
    assert resolve_impl("grouped_mm", torch.zeros(2, 2)) == "grouped_mm"
    with pytest.raises(ValueError, match="unknown grouped GEMM 'cutlass'"):
        resolve_impl("cutlass", torch.zeros(2, 2))
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)  # a torch without the kernel
    gg.cpu_grouped_mm_runs.cache_clear()
    try:
        assert resolve_impl("auto", torch.zeros(2, 2)) == "loop"
    finally:
        monkeypatch.undo()
        gg.cpu_grouped_mm_runs.cache_clear()


@pytest.fixture(scope="module")
def spec():
    return load_qwen3_moe_spec(tiny_config())


@pytest.fixture(scope="module")
def pair(world1, spec):
    """megatron-core's local modules and ours, holding the same weights."""
    torch.manual_seed(0)
    reference = build_model(spec, world1, SEQUENTIAL)
    ours = build_model(spec, world1, FAST)
    ours.load_state_dict(reference.state_dict())  # plain state dicts interchange
    return reference, ours


def test_default_modules_by_device(world1, spec):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP

    from backend.model.attention import SDPAttention
    from backend.model.experts import GroupedExperts

    layer = build_model(spec, world1).decoder.layers[0]
    assert isinstance(layer.mlp.experts, SequentialMLP)
    assert isinstance(layer.self_attention.core_attention, DotProductAttention)
    layer = build_model(spec, world1, FAST).decoder.layers[0]
    assert isinstance(layer.mlp.experts, GroupedExperts)
    assert isinstance(layer.self_attention.core_attention, SDPAttention)
    cuda, npu = BuildOptions(device="cuda"), BuildOptions(device="npu")
    assert (cuda.resolved_experts(), cuda.resolved_attention()) == ("grouped", "sdpa")
    assert (npu.resolved_experts(), npu.resolved_attention()) == ("grouped", "sdpa")


def test_outputs_and_gradients_match_megatron_modules(pair, spec):
    reference, ours = pair
    ids = torch.randint(0, spec.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    from backend.model.forward import forward_logits

    losses = []
    for model in pair:
        model.zero_grad(set_to_none=True)
        logits = forward_logits(model, ids)
        (logits.square().mean() + logits.logsumexp(-1).mean()).backward()
        losses.append(logits.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-5)
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    our_grads = {n: g for n, _, g in expanded_parameters(ours, grads=True)}
    assert our_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _attention_inputs(heads=4, groups=2, s=12, b=3, d=8):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(s, b, heads, d, generator=gen)
    k, v = (torch.randn(s, b, groups, d, generator=gen) for _ in range(2))
    return q, k, v


def test_sdpa_attention_matches_dot_product_attention(pair):
    reference, ours = pair
    ref_attn = reference.decoder.layers[0].self_attention.core_attention
    our_attn = ours.decoder.layers[0].self_attention.core_attention
    q, k, v = _attention_inputs(d=ours.config.kv_channels)
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)[None, None]
    expected = ref_attn(q, k, v, mask)
    torch.testing.assert_close(our_attn(q, k, v, mask), expected, rtol=0, atol=1e-6)
    # no mask on a causal layer, or backend.model.forward's own causal mask: SDPA's is_causal path
    # (flash on GPUs), which keeps no [s, s] mask for backward, gives the same
    from backend.model.forward import causal_mask, is_causal_mask

    torch.testing.assert_close(our_attn(q, k, v, None), expected, rtol=0, atol=1e-6)
    assert is_causal_mask(causal_mask(q.shape[0])) and not is_causal_mask(mask)
    torch.testing.assert_close(
        our_attn(q, k, v, causal_mask(q.shape[0])), expected, rtol=0, atol=1e-6
    )
    padding = mask | torch.tensor([False] * 9 + [True] * 3)  # last 3 keys hidden
    torch.testing.assert_close(
        our_attn(q, k, v, padding), ref_attn(q, k, v, padding), rtol=0, atol=1e-6
    )


def test_sdpa_attention_takes_thd_packed_sequences_only(pair):
    """Packed sequences in thd (tests/recipes/test_packed.py); other packed layouts are refused."""
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v = _attention_inputs(d=pair[1].config.kv_channels)
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    sbhd = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(ValueError, match="takes thd"):
        pair[1].decoder.layers[0].self_attention.core_attention(
            q, k, v, None, packed_seq_params=sbhd
        )


def _tensors_of(sharded_state_dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factories,
    )

    apply_factories(sharded_state_dict)
    out = {}
    for name, value in sharded_state_dict.items():
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            fields = (
                item.key,
                tuple(item.global_shape),
                tuple(item.global_offset),
                tuple(item.replica_id),
            )
            if isinstance(item, ShardedTensor):
                out[(name, i)] = (*fields, item.prepend_axis_num, item.data.detach().clone())
            else:
                assert isinstance(item, ShardedObject), type(item)
                out[(name, i)] = (*fields, item.data)
    return out


def test_sharded_state_dict_equals_sequential_mlp(pair):
    reference, ours = pair
    expected, got = (
        _tensors_of(reference.sharded_state_dict()),
        _tensors_of(ours.sharded_state_dict()),
    )
    assert got.keys() == expected.keys()
    for name, fields in expected.items():
        assert got[name][:-1] == fields[:-1], name
        if isinstance(fields[-1], torch.Tensor):
            assert torch.equal(got[name][-1], fields[-1]), name


@pytest.mark.parametrize("direction", ["sequential->grouped", "grouped->sequential"])
def test_dist_checkpoint_interchange(world1, spec, tmp_path, direction):
    from megatron.core import dist_checkpointing

    torch.manual_seed(3)
    first, second = (SEQUENTIAL, FAST) if direction.startswith("sequential") else (FAST, SEQUENTIAL)
    source, target = build_model(spec, world1, first), build_model(spec, world1, second)
    dist_checkpointing.save(source.sharded_state_dict(), str(tmp_path))
    target.load_state_dict(dist_checkpointing.load(target.sharded_state_dict(), str(tmp_path)))
    saved = {n: v for n, _, v in expanded_parameters(source)}
    loaded = {n: v for n, _, v in expanded_parameters(target)}
    assert saved.keys() == loaded.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def test_bad_expert_settings(world1, spec):
    from backend.model.experts import GroupedExperts

    model = build_model(spec, world1, FAST)
    config = model.config
    with pytest.raises(NotImplementedError, match="singleton_local_shards"):
        model.sharded_state_dict(metadata={"singleton_local_shards": True})
    config_gelu = type(config)(**{**config.__dict__, "activation_func": torch.nn.functional.gelu})
    with pytest.raises(ValueError, match="SwiGLU.*experts='sequential'"):
        GroupedExperts(2, config_gelu, groups=world1)
    with pytest.raises(ValueError, match="unknown experts 'fused'"):
        BuildOptions(experts="fused").resolved_experts()
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        BuildOptions(attention="flash").resolved_attention()


class _ReferenceTorchNpu:
    """torch_npu's two kernels as documented, in plain torch: checks our call wiring (layouts,
    group arguments, the backward's two GEMMs) on CPU; the kernels themselves need Ascend."""

    @staticmethod
    def npu_grouped_matmul(xs, ws, *, group_list, group_type, group_list_type, split_item):
        assert group_list_type == 1 and split_item == 3 and len(xs) == len(ws) == 1
        (x,), (w,), counts = xs, ws, group_list.tolist()
        if group_type == 0:  # split the rows of x: y_g = x_g @ w[g]
            return [torch.cat([xg @ w[g] for g, xg in enumerate(x.split(counts))])]
        assert group_type == 2  # split the reduction axis: out[g] = x[:, k_g] @ w[k_g, :]
        return [
            torch.stack([a @ b for a, b in zip(x.split(counts, 1), w.split(counts), strict=True)])
        ]

    @staticmethod
    def npu_fusion_attention(
        q, k, v, head_num, layout, *, atten_mask, scale, keep_prob, sparse_mode
    ):
        assert layout == "SBH" and keep_prob == 1.0
        s, b = q.shape[:2]
        q4, k4, v4 = (
            t.reshape(t.shape[0], b, -1, q.shape[-1] // head_num).permute(1, 2, 0, 3)
            for t in (q, k, v)
        )
        if sparse_mode == 2:  # compressed causal mask: its [s, s] corner
            assert atten_mask.shape == (2048, 2048)
            atten_mask = atten_mask[:s, :s]
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=~atten_mask, scale=scale, enable_gqa=True
        )
        return (out.permute(2, 0, 1, 3).reshape(s, b, -1),)


def test_npu_paths_against_reference_kernels(monkeypatch, pair):
    import sys

    from backend.model.forward import causal_mask
    from backend.model.grouped_gemm import _NpuGroupedLinear

    monkeypatch.setitem(sys.modules, "torch_npu", _ReferenceTorchNpu())
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 16, requires_grad=True)
    w = torch.randn(4, 24, 16, requires_grad=True)
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y, y_ref = (
        _NpuGroupedLinear.apply(x, w, counts),
        _reference_grouped(x_ref, w_ref, counts.tolist()),
    )
    grad = torch.randn_like(y_ref)
    y.backward(grad)
    y_ref.backward(grad)
    for ours, ref in ((y, y_ref), (x.grad, x_ref.grad), (w.grad, w_ref.grad)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)

    attention = pair[1].decoder.layers[0].self_attention.core_attention
    q, k, v = _attention_inputs(d=attention.config.kv_channels)
    expected = attention(q, k, v, causal_mask(q.shape[0]))
    torch.testing.assert_close(
        attention._npu(q, k, v, None, causal=True), expected, rtol=0, atol=1e-6
    )
    padding = causal_mask(q.shape[0]) | torch.tensor([False] * 9 + [True] * 3)
    torch.testing.assert_close(
        attention._npu(q, k, v, padding, causal=False),
        attention(q, k, v, padding),
        rtol=0,
        atol=1e-6,
    )
