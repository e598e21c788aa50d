"""Core attention through torch's scaled_dot_product_attention, without TransformerEngine.

`SDPAttention` replaces megatron-core's DotProductAttention (`core_attention` in the layer
spec). megatron's local attention materialises the [b, heads, s, s] scores in fp32 and
repeats K/V per query group; SDPA dispatches to flash / memory-efficient kernels that never
hold the score matrix, and reads grouped K/V directly (enable_gqa).

Masks follow megatron's convention (bool, True = blocked). With no mask on a causal layer (what
GPU callers pass) or backend.forward's own causal mask (CPU and Ascend callers), SDPA runs
`is_causal`, the flash path, and no [s, s] mask is kept for backward; any other mask (padding)
goes to SDPA as its complement.

On Ascend the same module calls torch_npu's fused attention (`npu_fusion_attention`, layout
SBH, GQA native): causal via its compressed 2048 x 2048 mask (sparse_mode 2) when no mask is
given, the explicit mask as is otherwise (its convention is megatron's).
"""

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from backend.forward import is_causal_mask


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
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                "SDPAttention takes padded [s, b] batches without attention bias: "
                "unpack the sequences (remove-padding off) or use the TE spec"
            )
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


_NPU_CAUSAL: dict[torch.device, torch.Tensor] = {}


def _npu_compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The fixed 2048 x 2048 upper-triangular mask sparse_mode 2 expects, whatever the length."""
    if device not in _NPU_CAUSAL:
        _NPU_CAUSAL[device] = torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)
    return _NPU_CAUSAL[device]
