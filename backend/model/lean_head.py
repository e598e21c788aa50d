"""Lean log-prob heads: per-token log-probs and entropy straight from the final hidden states.

The full path (GPTModel's output layer, then log-probs and entropy from its logits) holds
the [T, V/tp] logits and about three fp32 copies of them (temperature, cross entropy,
entropy's exp). Here the output projection is fused into the head and runs over chunks of
tokens: forward keeps per token only the log-sum-exp and the entropy, and backward
recomputes each chunk's logits from the saved hidden states, so no [T, V/tp] tensor exists.

Per token t, with z = (h_t W^T) / temp_t over the vocab (split across TP ranks: max and sums
are all-reduced over the TP group, as megatron's vocab-parallel cross entropy does):
    lse_t   = m_t + log sum_v exp(z_v - m_t),         m_t = max_v z_v
    logp_t  = z_{label_t} - lse_t
    H_t     = lse_t - sum_v p_v z_v,                   p = exp(z - lse_t)
    dlogp/dz = onehot(label) - p
    dH/dz    = -p (log p + H)
and dz/d(h W^T) = 1 / temp_t. Each rank's hidden-state gradient is its vocab shard's part;
the sequence-parallel gather's backward (reduce-scatter) sums them, as it does for the
output layer.
"""

from contextlib import contextmanager

import torch

CHUNK_BYTES = 256 * 2**20  # fp32 [chunk, V/tp] buffer per chunk (two live at a time)


def chunk_tokens(vocab_local: int, chunk_bytes: int | None = None) -> int:
    """Tokens per chunk so one fp32 [chunk, V/tp] buffer takes about chunk_bytes."""
    return max(1, (chunk_bytes or CHUNK_BYTES) // (4 * vocab_local))


def gpt_of(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "output_layer"):
        raise ValueError("the lean head needs the last pipeline stage (an output layer)")
    return model


def output_weight_VH(gpt) -> torch.Tensor:
    """This rank's [V/tp, H] rows of the output projection."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


@contextmanager
def output_layer_skipped(model):
    """GPTModel's output layer returns nothing (an empty last dim); yields the list its
    inputs (the final hidden states, [S(/tp), B, H]) are appended to."""
    layer, stash = gpt_of(model).output_layer, []

    def skip(hidden_SBH, weight=None, runtime_gather_output=None):
        stash.append(hidden_SBH)
        return hidden_SBH[..., :0], None

    layer.forward = skip
    try:
        yield stash
    finally:
        del layer.forward


def forward_hidden(model, input_ids_BS: torch.Tensor, packed=None) -> torch.Tensor:
    """Final hidden states [S, B, H] (after the final norm), full sequence on every TP rank.

    packed: PackedSeqParams of a packed [1, T] row, as backend.model.forward.forward_logits takes.

    Under sequence parallelism the output layer's input is this rank's [S/tp, B, H] slice:
    gathered here as ColumnParallelLinear would (backward: reduce-scatter, summing the vocab
    shards' partial gradients); plain TP copies in (backward: all-reduce).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    from backend.model.forward import forward_logits

    with output_layer_skipped(model) as stash:
        forward_logits(model, input_ids_BS, packed=packed)
    (hidden_SBH,) = stash
    if gpt_of(model).output_layer.sequence_parallel:
        return mappings.gather_from_sequence_parallel_region(hidden_SBH)
    if ps.get_tensor_model_parallel_world_size() > 1:
        return mappings.copy_to_tensor_model_parallel_region(hidden_SBH)
    return hidden_SBH


def lean_log_probs(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_T: torch.Tensor,
    temperature_T: torch.Tensor,
    entropy: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(label) [T], entropy [T] or None), fp32, differentiable w.r.t. hidden and weight.

    weight_VH is this rank's vocab shard (rows tp_rank * V/tp ...); labels are global ids.
    """
    chunk = chunk or chunk_tokens(weight_VH.shape[0])
    temperature_T = temperature_T.to(hidden_TH.device, torch.float32)
    if bool((temperature_T == 1).all()):
        temperature_T = None  # skips two [C, V/tp] passes per chunk
    logp_T, entropy_T = _LeanHead.apply(
        hidden_TH, weight_VH, labels_T, temperature_T, entropy, chunk
    )
    return logp_T, (entropy_T if entropy else None)


def _tp():
    """(TP group or None at tp 1, this rank's vocab offset factor: the TP rank)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return None, 0
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()


def _chunk_logits_CV(hidden_CH, weight_VH, temperature_C) -> torch.Tensor:
    """z = (h W^T).float() / temp: one fp32 [C, V/tp] buffer (the matmul in the weight's dtype);
    temperature_C None: 1 everywhere."""
    logits_CV = hidden_CH @ weight_VH.t()
    logits_CV = logits_CV.float() if logits_CV.dtype != torch.float32 else logits_CV
    return logits_CV if temperature_C is None else logits_CV.div_(temperature_C[:, None])


def _rows(tensor_T, sl):
    return None if tensor_T is None else tensor_T[sl]


def _local_label_C1(labels_C, vocab_start: int, vocab_local: int):
    """(local column [C, 1] clamped into range, mask [C] of labels on this rank's shard)."""
    local_C = labels_C - vocab_start
    on_rank_C = (local_C >= 0) & (local_C < vocab_local)
    return local_C.clamp(0, vocab_local - 1)[:, None], on_rank_C


def _chunk_stats(z_CV, labels_C, vocab_start: int, group, entropy: bool):
    """(logp [C], lse [C], entropy [C] or None) of one chunk; z_CV is overwritten."""
    import torch.distributed as dist

    max_C = z_CV.amax(-1)
    if group is not None:
        dist.all_reduce(max_C, op=dist.ReduceOp.MAX, group=group)
    z_CV.sub_(max_C[:, None])
    col_C1, on_rank_C = _local_label_C1(labels_C, vocab_start, z_CV.shape[1])
    exp_CV = z_CV.exp()
    sums_C3 = torch.stack(
        [
            exp_CV.sum(-1),
            z_CV.gather(1, col_C1).squeeze(1) * on_rank_C,
            exp_CV.mul_(z_CV).sum(-1) if entropy else torch.zeros_like(max_C),
        ],
        dim=1,
    )
    if group is not None:
        dist.all_reduce(sums_C3, group=group)
    sum_exp_C, label_z_C, sum_exp_z_C = sums_C3.unbind(1)
    log_sum_C = sum_exp_C.log()
    entropy_C = log_sum_C - sum_exp_z_C / sum_exp_C if entropy else None
    return label_z_C - log_sum_C, max_C + log_sum_C, entropy_C


class _LeanHead(torch.autograd.Function):
    """Chunked fused output projection + log-probs / entropy (module docstring)."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, labels_T, temperature_T, entropy, chunk):
        group, tp_rank = _tp()
        vocab_start = tp_rank * weight_VH.shape[0]
        logp_T = hidden_TH.new_empty(hidden_TH.shape[0], dtype=torch.float32)
        lse_T, entropy_T = torch.empty_like(logp_T), torch.empty_like(logp_T)
        for lo in range(0, hidden_TH.shape[0], chunk):
            sl = slice(lo, lo + chunk)
            z_CV = _chunk_logits_CV(hidden_TH[sl], weight_VH, _rows(temperature_T, sl))
            logp_T[sl], lse_T[sl], ent_C = _chunk_stats(
                z_CV, labels_T[sl], vocab_start, group, entropy
            )
            del z_CV  # before the next chunk's matmul: two [C, V/tp] buffers at most
            if entropy:
                entropy_T[sl] = ent_C
        ctx.save_for_backward(hidden_TH, weight_VH, labels_T, lse_T, entropy_T)
        ctx.temperature_T = temperature_T
        ctx.vocab_start, ctx.chunk, ctx.entropy = vocab_start, chunk, entropy
        ctx.set_materialize_grads(False)
        return logp_T, entropy_T

    @staticmethod
    def backward(ctx, grad_logp_T, grad_entropy_T):
        hidden_TH, weight_VH, labels_T, lse_T, entropy_T = ctx.saved_tensors
        temperature_T = ctx.temperature_T
        if not ctx.entropy:
            grad_entropy_T = None
        grad_hidden_TH = torch.zeros_like(hidden_TH) if ctx.needs_input_grad[0] else None
        grad_weight_VH = (
            torch.zeros_like(weight_VH, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        )
        if grad_logp_T is None and grad_entropy_T is None:
            return grad_hidden_TH, grad_weight_VH, None, None, None, None
        for lo in range(0, hidden_TH.shape[0], ctx.chunk):
            sl = slice(lo, lo + ctx.chunk)
            grads = (g[sl] if g is not None else None for g in (grad_logp_T, grad_entropy_T))
            grad_CV = _chunk_grad_logits_CV(
                hidden_TH[sl], weight_VH, labels_T[sl], _rows(temperature_T, sl), lse_T[sl],
                entropy_T[sl], *grads, ctx.vocab_start,
            )  # fmt: skip
            if grad_weight_VH is not None:  # from the fp32 gradient, accumulated in fp32
                grad_weight_VH.addmm_(grad_CV.t(), hidden_TH[sl].float())
            if grad_hidden_TH is not None:
                grad_hidden_TH[sl] = grad_CV.to(weight_VH.dtype) @ weight_VH
            del grad_CV  # before the next chunk's two buffers (a third held 1.5x the memory)
        if grad_weight_VH is not None:
            grad_weight_VH = grad_weight_VH.to(weight_VH.dtype)
        return grad_hidden_TH, grad_weight_VH, None, None, None, None


def _chunk_grad_logits_CV(
    hidden_CH, weight_VH, labels_C, temperature_C, lse_C, entropy_C, grad_logp_C,
    grad_entropy_C, vocab_start: int,
) -> torch.Tensor:  # fmt: skip
    """d loss / d(h W^T) for one chunk, recomputed (module docstring), fp32 [C, V/tp]:
    (-p (g_logp + g_H (log p + H)) + g_logp onehot) / temp."""
    logp_CV = _chunk_logits_CV(hidden_CH, weight_VH, temperature_C).sub_(lse_C[:, None])
    p_CV = logp_CV.exp()
    g_logp_C = grad_logp_C if grad_logp_C is not None else torch.zeros_like(lse_C)
    if grad_entropy_C is not None:
        coef_CV = logp_CV.add_(entropy_C[:, None]).mul_(grad_entropy_C[:, None])
        grad_CV = p_CV.mul_(coef_CV.add_(g_logp_C[:, None])).neg_()
    else:
        del logp_CV
        grad_CV = p_CV.mul_(-g_logp_C[:, None])
    col_C1, on_rank_C = _local_label_C1(labels_C, vocab_start, grad_CV.shape[1])
    grad_CV.scatter_add_(1, col_C1, (g_logp_C * on_rank_C)[:, None])
    return grad_CV if temperature_C is None else grad_CV.div_(temperature_C[:, None])
