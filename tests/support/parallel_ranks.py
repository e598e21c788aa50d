"""Rank functions for the multi-process parity tests (module level: spawn imports them)."""

import torch
import torch.distributed as dist

from tests.support.multiproc import loaded_model

BATCH, SEQ = 4, 16


def global_batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))


def _pipeline_forward_backward(model, groups, ids, loss_fn):
    """Two-stage handoff (pp=2) through GPTModel's own stage split; returns last-stage logits."""
    from backend.model.forward import forward_logits

    stage, b, s = groups.rank("pp"), ids.shape[0], ids.shape[1]
    hidden_shape = (s // groups.size("tp"), b, model.config.hidden_size)
    pp_ranks = dist.get_process_group_ranks(groups.pp)
    if stage == 0:
        out = forward_logits(model, ids)  # hidden states [s(/tp), b, h] on the first stage
        dist.send(out.detach().contiguous(), pp_ranks[1])
        grad = torch.empty_like(out)
        dist.recv(grad, pp_ranks[1])
        out.backward(grad)
        return None
    received = torch.empty(hidden_shape)
    dist.recv(received, pp_ranks[0])
    received.requires_grad_(True)
    model.set_input_tensor(received)
    logits = forward_logits(model, ids)
    loss_fn(logits).backward()
    dist.send(received.grad.contiguous(), pp_ranks[0])
    return logits


def _untagged_norms() -> None:
    """Norms that accept sequence parallelism without tagging their weights, as a device's own
    norm may (MindSpeed's on Ascend): build_model must tag them itself."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        return torch.nn.RMSNorm(hidden_size, eps=eps)

    WrappedTorchNorm.__new__ = staticmethod(new)


def run_plan(
    rank: int, hf_dir: str, tp: int, ep: int, pp: int, etp: int = 1, fast: bool = False,
    untagged_norms: bool = False,
) -> dict:  # fmt: skip
    """Load the tiny HF model at this plan, run the global batch, return loss/logits/grads.

    fast: our GroupedExperts + SDPAttention instead of megatron-core's local modules.
    untagged_norms: norms as on Ascend, which the shim does not build (see _untagged_norms)."""
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    if untagged_norms:
        _untagged_norms()
    from backend.model.build import BuildOptions
    from backend.model.forward import token_log_probs
    from tests.support.oracles import gather_full
    from tests.support.reference_actor import sync_grads

    modules = dict(experts="grouped", attention="sdpa") if fast else {}
    model, spec, groups = loaded_model(
        hf_dir, BuildOptions(**modules), tp=tp, ep=ep, pp=pp, etp=etp
    )

    dp, dp_rank = groups.size("dp"), groups.rank("dp")
    ids = global_batch(spec.vocab_size).chunk(dp)[dp_rank]
    n_tokens = BATCH * (SEQ - 1)
    out = {}

    def loss_fn(logits):
        logp = token_log_probs(logits[:, :-1], ids[:, 1:])
        loss = -logp.sum() / n_tokens  # token mean over the global batch
        out["loss"] = loss.detach().clone()
        out["logits"] = _gather_vocab(logits.detach(), groups)
        return loss

    if pp == 1:
        from backend.model.forward import forward_logits

        loss_fn(forward_logits(model, ids)).backward()
    else:
        _pipeline_forward_backward(model, groups, ids, loss_fn)
    sync_grads(model, groups)  # what mcore's DDP + finalize_model_grads do, DP summed
    grads = gather_full(model, groups, spec, grads=True)
    last_stage = groups.rank("pp") == groups.size("pp") - 1
    if last_stage:
        dist.all_reduce(out["loss"], group=groups.dp)
    return {
        "dp_rank": dp_rank,
        "last_stage": last_stage,
        "loss": out.get("loss"),
        "logits": out.get("logits"),
        "grads": grads if rank == 0 else None,
    }


def _gather_vocab(logits_BSV, groups):
    if groups.size("tp") == 1:
        return logits_BSV
    parts = [torch.empty_like(logits_BSV) for _ in range(groups.size("tp"))]
    dist.all_gather(parts, logits_BSV.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1)


def run_actor_step(rank: int, hf_dir: str, tp: int, ep: int, max_norm: float) -> dict:
    """One McoreActor step (token-mean NLL, clipped AdamW) at a plan; its full synced grads."""
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    from tests.support.oracles import gather_full
    from tests.support.reference_actor import McoreActor, OptimConfig

    model, spec, groups = loaded_model(hf_dir, tp=tp, ep=ep)
    actor = McoreActor(model, groups, OptimConfig(lr=1e-2, grad_clip=max_norm))
    ids = global_batch(spec.vocab_size).chunk(groups.size("dp"))[groups.rank("dp")]
    metrics = actor.train_step([{"input_ids": ids}], nll_token_mean)
    return {
        "grad_norm": metrics["actor/grad_norm"],
        "grads": gather_full(model, groups, spec, grads=True),
    }


def nll_token_mean(log_probs, micro_batch):
    loss = -log_probs.sum() / (BATCH * (SEQ - 1))
    return loss, {"loss": loss.detach()}


def experts_chosen_SBK(routing_map_TE: torch.Tensor, seq: int, k: int) -> torch.Tensor:
    """A router call's routing map (sequence-major tokens) as its experts' ids [S, B, K],
    ascending per token."""
    per_token = routing_map_TE.sum(-1)
    if not (per_token == k).all():  # a token dropped or sent to more experts than top-k
        raise AssertionError(f"tokens routed to {per_token.unique().tolist()} experts, not {k}")
    ids_TK = routing_map_TE.nonzero()[:, 1].reshape(-1, k)  # nonzero walks each row in order
    return ids_TK.reshape(seq, -1, k)


def routed_plan(rank: int, hf_dir: str, tp: int, ep: int, pp: int, etp: int = 1) -> dict:
    """Forward only at this plan: the logits (full vocabulary, last stage) and, per layer this
    rank routes, the experts chosen for its tokens [S(/tp), B/dp, K] (sequence parallel: the
    TP rank's contiguous slice of S)."""
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    from backend.instruments.router_tap import RouterTap
    from backend.model.forward import forward_logits

    model, spec, groups = loaded_model(hf_dir, tp=tp, ep=ep, pp=pp, etp=etp)
    ids = global_batch(spec.vocab_size).chunk(groups.size("dp"))[groups.rank("dp")]
    seq_local = SEQ // tp  # sequence parallel whenever tp > 1
    chosen = {}

    def record(call):
        chosen[call.layer] = experts_chosen_SBK(call.routing_map_TE, seq_local, spec.top_k)

    tap = RouterTap(model.eval(), groups)
    tap.add_listener(record)
    stage, last_stage = groups.rank("pp"), groups.rank("pp") == groups.size("pp") - 1
    pp_ranks = dist.get_process_group_ranks(groups.pp)
    with torch.no_grad():
        if stage > 0:  # the previous stage's hidden states [S(/tp), B, H]
            received = torch.empty(seq_local, ids.shape[0], model.config.hidden_size)
            dist.recv(received, pp_ranks[stage - 1])
            model.set_input_tensor(received)
        out = forward_logits(model, ids)
        if not last_stage:
            dist.send(out.contiguous(), pp_ranks[stage + 1])
    tap.remove()
    return {
        "dp_rank": groups.rank("dp"),
        "tp_rank": groups.rank("tp"),
        "logits": _gather_vocab(out, groups) if last_stage else None,
        "chosen": chosen,
    }
