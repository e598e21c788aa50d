"""Per-token outputs verl's losses read: log-probs (and entropy) from vocab-parallel logits.

verl's convention (no_padding_2_padding, response_from_nested): output position t holds the
value for predicting token t + 1, so a response of r tokens ending at position L reads
positions L - r - 1 .. L - 2; the last position of each row is unused (0 here).
"""

import torch
import torch.nn.functional as F

from backend.forward import forward_logits, token_log_probs


def _temperature_B11(temperature, batch: int, device) -> torch.Tensor | float:
    if isinstance(temperature, torch.Tensor) and temperature.numel() == batch:
        return temperature.to(device, torch.float32).clamp_min(1e-8).view(batch, 1, 1)
    value = (
        float(temperature.flatten()[0])
        if isinstance(temperature, torch.Tensor)
        else float(temperature)
    )
    return max(value, 1e-8)


def head_outputs(
    model, ids_BS: torch.Tensor, temperature=1.0, entropy: bool = False, packed=None
) -> dict:
    """{"log_probs": [B, S], "entropy": [B, S] when asked}, differentiable, fp32.

    packed: PackedSeqParams of a packed [1, T] row (backend.forward.forward_logits); the
    log-prob at each sequence's last token then reads the next sequence's first: the caller
    masks it (MicroBatch.has_next_BS)."""
    logits_BSV = forward_logits(model, ids_BS, packed=packed)
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
