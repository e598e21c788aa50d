"""Forward helpers on a megatron-core GPTModel: masks, logits, per-token log-probs."""

from functools import lru_cache

import torch


@lru_cache(maxsize=2)
def _causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """mcore's attention mask convention: bool [1, 1, s, s], True where attention is blocked.

    Passed explicitly because megatron-core's default mask is created on 'cuda'. The same
    (cached, never written) tensor comes back for the same length and device, so attention
    kernels can recognise it (`is_causal_mask`) and run their causal path without it.
    """
    return _causal_mask(seq_len, torch.device(device))


def is_causal_mask(mask: torch.Tensor | None) -> bool:
    """True for the tensor causal_mask hands out, or a detached alias of it.

    Activation recompute replays the layers on `mask.detach()` (megatron's CheckpointFunction
    saves its inputs and detaches them for the replay): a new tensor object over the same
    memory. Same storage, offset, shape and strides means the same values, as the cached mask
    is never written; no device sync, no element compare.
    """
    if mask is None or mask.dim() != 4 or mask.dtype != torch.bool:
        return False
    causal = _causal_mask(mask.shape[-1], mask.device)
    return mask is causal or (
        mask.data_ptr() == causal.data_ptr()
        and mask.shape == causal.shape
        and mask.stride() == causal.stride()
    )


def attention_mask_for(input_ids_BS: torch.Tensor) -> torch.Tensor | None:
    """None on CUDA: megatron's attention and ours (SDPA, flash kernels) then apply causality
    themselves without an [s, s] mask; elsewhere the explicit causal mask."""
    if input_ids_BS.device.type == "cuda":
        return None
    return causal_mask(input_ids_BS.shape[1], input_ids_BS.device)


def forward_logits(model, input_ids_BS: torch.Tensor, packed=None) -> torch.Tensor:
    """Vocab-parallel logits [B, S, V/tp] for right-padded or unpadded input; on a pipeline
    stage before the last, the stage's hidden states [S(/tp), B, H] (sent to the next).

    packed: megatron-core PackedSeqParams (THD) of a packed [1, T] row: attention stays
    within each sequence (cu_seqlens), positions restart at every sequence start."""
    if packed is not None:
        position_ids_1T = packed_position_ids(packed.cu_seqlens_q)[None]
        return model(input_ids_BS, position_ids_1T, None, packed_seq_params=packed)
    b, s = input_ids_BS.shape
    position_ids_BS = torch.arange(s, device=input_ids_BS.device).expand(b, s)
    return model(input_ids_BS, position_ids_BS, attention_mask_for(input_ids_BS))


def packed_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] positions restarting at each start in cu_seqlens ([N + 1], last = T)."""
    lengths_N = cu_seqlens.diff().long()
    starts_T = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths_N)
    return torch.arange(starts_T.numel(), device=cu_seqlens.device) - starts_T


def token_log_probs(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """log p(label) per token [B, S] from vocab-parallel logits (exact across the TP group).

    Uses megatron-core's vocab-parallel cross entropy, so the full vocab is never gathered.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # mcore works in [S, B] order and overwrites its input in place: hand it exactly one
    # fp32 copy (transpose, cast and ownership in a single differentiable copy_)
    b, s, v = logits_BSV.shape
    logits_SBV = logits_BSV.new_empty((s, b, v), dtype=torch.float32)
    logits_SBV.copy_(logits_BSV.transpose(0, 1))
    nll_SB = vocab_parallel_cross_entropy(logits_SBV, labels_BS.t().contiguous())
    return -nll_SB.t()


def next_token_log_probs(model, input_ids_BS: torch.Tensor) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) per position [B, S-1], as an RL actor scores responses."""
    logits_BSV = forward_logits(model, input_ids_BS)
    return token_log_probs(logits_BSV[:, :-1], input_ids_BS[:, 1:])
