"""Per-token outputs verl's losses read: log-probs (and entropy) from vocab-parallel logits.

verl's convention (no_padding_2_padding, response_from_nested): output position t holds the
value for predicting token t + 1, so a response of r tokens ending at position L reads
positions L - r - 1 .. L - 2; the last position of each row is unused (0 here).
"""

import torch
import torch.nn.functional as F

from backend.model.forward import forward_logits, token_log_probs
from backend.model.lean_head import forward_hidden, gpt_of, lean_log_probs, output_weight_VH


def _temperature_B11(temperature, batch: int, device) -> torch.Tensor | float:
    if isinstance(temperature, torch.Tensor) and temperature.numel() == batch:
        return temperature.to(device, torch.float32).clamp_min(1e-8).view(batch, 1, 1)
    value = (
        float(temperature.flatten()[0])
        if isinstance(temperature, torch.Tensor)
        else float(temperature)
    )
    return max(value, 1e-8)


def _temperature_B(temperature, batch: int, device) -> torch.Tensor:
    scale = _temperature_B11(temperature, batch, device)
    if isinstance(scale, float):
        return torch.full((batch,), scale, dtype=torch.float32, device=device)
    return scale.view(batch)


def head_outputs(
    model,
    ids_BS: torch.Tensor,
    temperature=1.0,
    entropy: bool = False,
    lean: bool = True,
    packed=None,
) -> dict:
    """{"log_probs": [B, S], "entropy": [B, S] when asked}, differentiable, fp32.

    lean: backend.model.lean_head (chunked, the output projection fused, no [T, V/tp] logits held);
    otherwise the full logits (full_head_outputs), the reference it is tested against.
    packed: PackedSeqParams of a packed [1, T] row (backend.model.forward.forward_logits); the
    log-prob at each sequence's last token then reads the next sequence's first: the caller
    masks it (MicroBatch.has_next_BS).
    """
    if not lean:
        return full_head_outputs(model, ids_BS, temperature, entropy, packed=packed)
    return head_from_hidden(model, forward_hidden(model, ids_BS, packed=packed), ids_BS,
                            temperature, entropy)  # fmt: skip


def head_from_hidden(
    model, hidden_SBH: torch.Tensor, ids_BS: torch.Tensor, temperature=1.0, entropy: bool = False
) -> dict:
    """head_outputs' lean head on final hidden states [S, B, H] (backend.model.lean_head)."""
    s, b, h = hidden_SBH.shape
    labels_SB = F.pad(ids_BS[:, 1:], (0, 1)).t()  # the last position's label is never read
    temperature_SB = _temperature_B(temperature, b, ids_BS.device).expand(s, b)
    logp_T, entropy_T = lean_log_probs(
        hidden_SBH.reshape(s * b, h),
        output_weight_VH(gpt_of(model)),
        labels_SB.reshape(-1),
        temperature_SB.reshape(-1),
        entropy,
    )
    out = {"log_probs": F.pad(logp_T.view(s, b).t()[:, :-1], (0, 1))}
    if entropy:
        out["entropy"] = entropy_T.view(s, b).t().contiguous()
    return out


def full_head_outputs(
    model, ids_BS: torch.Tensor, temperature=1.0, entropy: bool = False, packed=None
) -> dict:
    """head_outputs from the full [B, S, V/tp] logits (about three fp32 copies of them)."""
    return full_head_from_logits(forward_logits(model, ids_BS, packed=packed), ids_BS,
                                 temperature, entropy)  # fmt: skip


def full_head_from_logits(
    logits_BSV: torch.Tensor, ids_BS: torch.Tensor, temperature=1.0, entropy: bool = False
) -> dict:
    """full_head_outputs on the model's logits [B, S, V/tp]."""
    scale = _temperature_B11(temperature, ids_BS.shape[0], ids_BS.device)
    if not (isinstance(scale, float) and scale == 1.0):
        logits_BSV = logits_BSV.float() / scale
    out = {"log_probs": F.pad(token_log_probs(logits_BSV[:, :-1], ids_BS[:, 1:]), (0, 1))}
    if entropy:
        out["entropy"] = vocab_parallel_entropy(logits_BSV.float())
    return out


def vocab_parallel_entropy(logits_BSV: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the vocab split across TP ranks, differentiable.

    (verl's own version wraps a torch.compile call, which needs a compiler on CPU.)
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    max_BS1 = logits_BSV.detach().amax(-1, keepdim=True)
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(max_BS1, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    exp_BSV = (logits_BSV - max_BS1).exp()
    sum_exp_BS1 = reduce_from_tensor_model_parallel_region(exp_BSV.sum(-1, keepdim=True))
    mean_logit_BS1 = (
        reduce_from_tensor_model_parallel_region((exp_BSV * logits_BSV).sum(-1, keepdim=True))
        / sum_exp_BS1
    )
    return (max_BS1 + sum_exp_BS1.log() - mean_logit_BS1).squeeze(-1)
