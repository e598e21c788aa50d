"""Router balancing and z-losses as pure functions of one router call's tensors.

Notation (one MoE layer): E experts, top-k routing, T tokens in the call, of which the
valid ones (mask `valid_T`, None = all) count. p_ti = softmax(logits_t)_i over all E
experts (not the renormalised top-k weights), C_i = number of valid (token, slot)
assignments to expert i, N = number of valid tokens.

Switch / GShard balancing loss (Switch Transformer eq. 4-6, megatron-core's
switch_load_balancing_loss_func):

    L = E * sum_i f_i * P_i,   f_i = C_i / (k * N),   P_i = (1 / N) * sum_t p_ti

Normalisation: f is the fraction of the N * k routed slots that went to expert i, so
sum_i f_i = 1 and uniform routing (f_i = P_i = 1 / E) gives L = 1 for any k. transformers'
load_balancing_loss_func counts per slot without dividing by k and reports k * L.
f is a count, so it carries no gradient; the gradient flows through P.

Levels: micro-batch (f, P over the micro-batch), sequence (L per sequence, then the mean
over sequences with a valid token), global batch (f, P over every valid token of the
optimizer step, all micro-batches and ranks). The hook evaluates each as a sum of
per-call shares `balance_share` (and `sequence_share`) so the same code serves all.

Router z-loss (ST-MoE eq. 5): Z = (1 / N) * sum_t logsumexp(logits_t)^2 over valid tokens.
"""

import torch


def _weights_T(valid_T: torch.Tensor | None, num_tokens: int, device) -> torch.Tensor:
    if valid_T is None:
        return torch.ones(num_tokens, device=device)
    return valid_T.to(device=device, dtype=torch.float32)


def valid_count(valid_T: torch.Tensor | None, num_tokens: int) -> int:
    return num_tokens if valid_T is None else int(valid_T.sum())


def routed_counts_E(
    routing_map_TE: torch.Tensor, valid_T: torch.Tensor | None = None
) -> torch.Tensor:
    """C_i: valid (token, slot) assignments per expert, int64 [E]."""
    routed_TE = routing_map_TE if valid_T is None else routing_map_TE & valid_T[:, None]
    return routed_TE.sum(0, dtype=torch.int64)


def expert_fractions_E(counts_E: torch.Tensor, num_tokens, top_k: int) -> torch.Tensor:
    """f_i = C_i / (k * N): the share of routed slots per expert (sums to 1), fp32 [E].

    N = 0 (no valid token) gives f = 0, not NaN: such a call adds nothing.
    """
    n = torch.as_tensor(num_tokens, dtype=torch.float64, device=counts_E.device).clamp(min=1)
    return (counts_E.to(torch.float64) / (top_k * n)).to(torch.float32)


def prob_sums_E(logits_TE: torch.Tensor, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """sum_t p_ti over valid tokens, fp32 [E] (differentiable)."""
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    return _weights_T(valid_T, probs_TE.shape[0], probs_TE.device) @ probs_TE


def balance_share(logits_TE, f_E, num_tokens, valid_T=None) -> torch.Tensor:
    """E * sum_i f_i * (sum over this call's valid tokens of p_ti) / N.

    With f and N of the whole level (micro-batch or global batch) and the calls' token
    sets partitioning that level, the shares sum to the level's L; each share's gradient
    is the level loss's gradient through this call's tokens.
    """
    num_experts = logits_TE.shape[-1]
    return num_experts * (f_E.detach() * prob_sums_E(logits_TE, valid_T)).sum() / num_tokens


def sequence_stats(routing_map_TE, seq_T, num_seqs: int, valid_T=None):
    """Per-sequence counts C_si (int64 [B, E]) and valid tokens n_s (int64 [B])."""
    weights_T = _weights_T(valid_T, seq_T.shape[0], seq_T.device).to(torch.int64)
    counts_BE = torch.zeros(
        num_seqs, routing_map_TE.shape[-1], dtype=torch.int64, device=seq_T.device
    )
    counts_BE.index_add_(0, seq_T, routing_map_TE.to(torch.int64) * weights_T[:, None])
    tokens_B = torch.zeros(num_seqs, dtype=torch.int64, device=seq_T.device).index_add_(
        0, seq_T, weights_T
    )
    return counts_BE, tokens_B


def sequence_share(logits_TE, seq_T, counts_BE, tokens_B, total_seqs, top_k: int, valid_T=None):
    """(1 / B_total) * sum over this call's sequences of L_s, L_s = E * sum_i f_si * P_si.

    counts_BE / tokens_B are whole-sequence statistics (summed over sequence-parallel
    slices); this call's tokens contribute their part of P_s. Sequences with no valid
    token contribute 0 and are not counted in `total_seqs`.
    """
    num_experts = logits_TE.shape[-1]
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    probs_TE = probs_TE * _weights_T(valid_T, probs_TE.shape[0], probs_TE.device)[:, None]
    psum_BE = torch.zeros(counts_BE.shape, device=probs_TE.device).index_add(0, seq_T, probs_TE)
    n_B = tokens_B.clamp(min=1).to(torch.float32)
    f_BE = (counts_BE.to(torch.float32) / (top_k * n_B[:, None])).detach()
    per_seq_B = num_experts * (f_BE * psum_BE).sum(-1) / n_B
    return per_seq_B.sum() / total_seqs


def z_share(logits_TE, num_tokens, valid_T=None) -> torch.Tensor:
    """(1 / N) * sum over this call's valid tokens of logsumexp(logits_t)^2."""
    lse_T = torch.logsumexp(logits_TE.float(), dim=-1)
    return (_weights_T(valid_T, lse_T.shape[0], lse_T.device) * lse_T.square()).sum() / num_tokens
