"""Core attention through torch's scaled_dot_product_attention, without TransformerEngine.

`SDPAttention` replaces megatron-core's DotProductAttention (`core_attention` in the layer
spec). megatron's local attention materialises the [b, heads, s, s] scores in fp32 and
repeats K/V per query group; SDPA dispatches to flash / memory-efficient kernels that never
hold the score matrix, and reads grouped K/V directly (enable_gqa).

Masks follow megatron's convention (bool, True = blocked). With no mask on a causal layer (what
GPU callers pass) or backend.model.forward's own causal mask (CPU and Ascend callers), SDPA runs
`is_causal`, the flash path, and no [s, s] mask is kept for backward; any other mask (padding)
goes to SDPA as its complement.

On Ascend the same module calls torch_npu's fused attention (`npu_fusion_attention`, layout
SBH, GQA native): causal via its compressed 2048 x 2048 mask (sparse_mode 2) when no mask is
given, the explicit mask as is otherwise (its convention is megatron's).

Packed sequences (PackedSeqParams, qkv_format "thd"; megatron hands [t, heads, d]): causal
attention within each sequence of cu_seqlens. CUDA: flash-attn's varlen kernel when
importable, otherwise SDPA per sequence (`is_causal`, flash path). CPU (the exact
reference): torch's CPU flash kernel (what SDPA dispatches to there) per sequence, written
into one output tensor (`_CpuPackedCausal`: no concatenated copy kept for backward; SDPA per
sequence when training with attention dropout). Ascend: npu_fusion_attention in TND
layout with actual_seq_qlen / actual_seq_kvlen (sparse_mode 3, causal per sequence) -
written to torch_npu's documented interface, not run here (no NPU in CI).
"""

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from backend.model.forward import is_causal_mask


class SDPAttention(MegatronModule):
    """query [sq, b, heads, d], key/value [sk, b, groups, d] -> [sq, b, heads * d]."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError(
                "SDPAttention does not split sequences over context parallel ranks: "
                "use cp=1, or TransformerEngine's attention (spec='te')"
            )
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        if config.apply_query_key_layer_scaling:
            raise ValueError(
                "apply_query_key_layer_scaling is fp16-only and not supported by SDPAttention"
            )
        self.softmax_scale = scale

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias: use the TE spec")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if is_causal_mask(attention_mask):
            attention_mask, attn_mask_type = None, AttnMaskType.causal
        causal = (
            attention_mask is None
            and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        )
        if query.device.type == "npu":
            return self._npu(query, key, value, attention_mask, causal)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        keep = None if attention_mask is None else ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=keep,
            is_causal=causal,
            scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, q_THD, k_TGD, v_TGD, packed) -> torch.Tensor:
        """THD: causal attention within each sequence -> [t, heads * d]."""
        if packed.qkv_format != "thd":
            raise ValueError(f"packed sequences in {packed.qkv_format!r}: SDPAttention takes thd")
        if not torch.equal(packed.cu_seqlens_q, packed.cu_seqlens_kv):
            raise ValueError("SDPAttention packs self-attention only (cu_seqlens_q == _kv)")
        if q_THD.dim() == 4:  # megatron-core versions that keep the batch dim of 1
            q_THD, k_TGD, v_TGD = (t.squeeze(1) for t in (q_THD, k_TGD, v_TGD))
        dropout = self.dropout if self.training else 0.0
        device = q_THD.device.type
        if device == "npu":
            return self._npu_packed(q_THD, k_TGD, v_TGD, packed.cu_seqlens_q, dropout)
        half = q_THD.dtype in (torch.float16, torch.bfloat16)  # flash-attn's dtypes
        varlen = _flash_varlen() if device == "cuda" and half else None
        if varlen is not None:
            out_THD = varlen(
                q_THD, k_TGD, v_TGD, packed.cu_seqlens_q, packed.cu_seqlens_kv,
                packed.max_seqlen_q, packed.max_seqlen_kv, dropout_p=dropout,
                softmax_scale=self.softmax_scale, causal=True,
            )  # fmt: skip
            return out_THD.reshape(out_THD.shape[0], -1)
        lengths = packed.cu_seqlens_q.diff().tolist()
        if device == "cpu" and dropout == 0.0 and _cpu_flash_ops() is not None:
            out_THD = _CpuPackedCausal.apply(q_THD, k_TGD, v_TGD, lengths, self.softmax_scale)
            return out_THD.view(out_THD.shape[0], -1)
        return self._per_sequence(q_THD, k_TGD, v_TGD, packed.cu_seqlens_q, dropout)

    def _per_sequence(self, q_THD, k_TGD, v_TGD, cu_seqlens, dropout: float) -> torch.Tensor:
        """SDPA causal on each sequence: exact, no [t, t] mask."""
        lengths = cu_seqlens.diff().tolist()
        outs = []
        for q, k, v in zip(*(t.split(lengths) for t in (q_THD, k_TGD, v_TGD)), strict=True):
            q_HSD, k_GSD, v_GSD = (t.transpose(0, 1)[None] for t in (q, k, v))
            out = F.scaled_dot_product_attention(
                q_HSD, k_GSD, v_GSD, is_causal=True, scale=self.softmax_scale,
                dropout_p=dropout, enable_gqa=q_HSD.shape[1] != k_GSD.shape[1],
            )  # fmt: skip
            outs.append(out[0].transpose(0, 1).reshape(q.shape[0], -1))
        return torch.cat(outs)

    def _npu_packed(self, q_THD, k_TGD, v_TGD, cu_seqlens, dropout: float) -> torch.Tensor:
        """Untested here (no NPU): torch_npu's TND layout, causal within each sequence."""
        import torch_npu

        ends = cu_seqlens[1:].tolist()
        out = torch_npu.npu_fusion_attention(
            q_THD, k_TGD, v_TGD, q_THD.shape[1], "TND",
            atten_mask=_npu_compressed_causal_mask(q_THD.device), scale=self.softmax_scale,
            keep_prob=1.0 - dropout, sparse_mode=3, actual_seq_qlen=ends, actual_seq_kvlen=ends,
        )  # fmt: skip
        return out[0].reshape(q_THD.shape[0], -1)

    def _npu(self, query, key, value, attention_mask, causal: bool):
        import torch_npu

        sq, b, heads, _ = query.shape
        mask = _npu_compressed_causal_mask(query.device) if causal else attention_mask
        out = torch_npu.npu_fusion_attention(
            query.reshape(sq, b, -1),
            key.reshape(key.shape[0], b, -1),
            value.reshape(value.shape[0], b, -1),
            heads,
            "SBH",
            atten_mask=mask,
            scale=self.softmax_scale,
            keep_prob=1.0 - (self.dropout if self.training else 0.0),
            sparse_mode=2 if causal else 0,
        )
        return out[0]


class _CpuPackedCausal(torch.autograd.Function):
    """Causal attention within each sequence, on CPU, into one [t, heads, d] output.

    The same kernel F.scaled_dot_product_attention runs on CPU (its flash kernel), called per
    sequence; each output is written into a slice of one preallocated tensor, which backward
    keeps and linear_proj saves too (one copy, as on the padded path). Per-sequence SDPA +
    torch.cat kept two per layer: SDPA's outputs for its backward and the concatenation.
    """

    @staticmethod
    def forward(ctx, q_THD, k_TGD, v_TGD, lengths: list[int], scale: float):
        flash, _ = _cpu_flash_ops()
        out_THD = q_THD.new_empty(q_THD.shape)
        lse = []
        pieces = (t.split(lengths) for t in (q_THD, k_TGD, v_TGD, out_THD))
        for q, k, v, out in zip(*pieces, strict=True):
            o_HSD, lse_HS = flash(*(_hsd(t) for t in (q, k, v)), 0.0, True, scale=scale)
            out.copy_(o_HSD[0].transpose(0, 1))
            lse.append(lse_HS)
        ctx.save_for_backward(q_THD, k_TGD, v_TGD, out_THD, *lse)
        ctx.lengths, ctx.scale = lengths, scale
        return out_THD

    @staticmethod
    def backward(ctx, grad_THD):
        _, flash_backward = _cpu_flash_ops()
        q_THD, k_TGD, v_TGD, out_THD, *lse = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (q_THD, k_TGD, v_TGD)]
        tensors = (grad_THD.contiguous(), q_THD, k_TGD, v_TGD, out_THD, *grads)
        for pieces in zip(*(t.split(ctx.lengths) for t in tensors), lse, strict=True):
            g, q, k, v, out, dq, dk, dv, lse_HS = pieces
            args = (_hsd(t) for t in (g, q, k, v, out))
            dq_dk_dv = flash_backward(*args, lse_HS, 0.0, True, scale=ctx.scale)
            for into, d in zip((dq, dk, dv), dq_dk_dv, strict=True):
                into.copy_(d[0].transpose(0, 1))
        return *grads, None, None


def _hsd(t_SHD: torch.Tensor) -> torch.Tensor:
    return t_SHD.transpose(0, 1)[None]  # [1, heads, s, d], a view


def _cpu_flash_ops():
    """torch's CPU flash-attention forward / backward (what SDPA dispatches to on CPU), None
    on a torch without them."""
    ops = torch.ops.aten
    if not hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return None
    return (
        ops._scaled_dot_product_flash_attention_for_cpu,
        ops._scaled_dot_product_flash_attention_for_cpu_backward,
    )


def _flash_varlen():
    """flash-attn's flash_attn_varlen_func, None when the stack has no flash-attn."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


_NPU_CAUSAL: dict[torch.device, torch.Tensor] = {}


def _npu_compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The fixed 2048 x 2048 upper-triangular mask sparse_mode 2 expects, whatever the length."""
    if device not in _NPU_CAUSAL:
        _NPU_CAUSAL[device] = torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)
    return _NPU_CAUSAL[device]
