"""The mcore_ep engine's router aux-loss gradient against the hand-written reference.

(aux on) - (aux off): the router weights' gradients of the same batch and verl loss through
two engines, read after megatron-core DDP's reduction (backend.training.optim's reduce_grads: the DP
mean), against tests/test_aux_loss_hook.reference_step on one rank, the aux loss's gradient
written out directly from the routers' outputs over the whole batch. At dp > 1 the two agree
only through the aux gradient's DP scale (backend.instruments.router_instruments.aux_grad_scale).
"""

import torch
import torch.distributed as dist

from recipes.dapo.engine import batches
from tests.backend.test_aux_loss_hook import COEFF, Z_COEFF, _tiny_mcore, reference_step

# reference_step's coefficients; tokens: the responses, as the cluster recipe counts them
SCOPE = "response"


def aux_settings(kind: str, **extra) -> dict:
    """The engine's aux_loss setting of `kind` with reference_step's coefficients."""
    return dict(mode="on", type=kind, coeff=COEFF, z_coeff=Z_COEFF, scope=SCOPE, **extra)


def reduced_router_grads(engine, data, loss_fn) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metrics, full router-weight gradients) of one forward_backward_batch, after DDP's
    reduction over DP, on every rank (collective: every rank calls it)."""
    from tests.support.oracles import gather_full

    with engine.train_mode(zero_grad_on_exit=False):
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(data, loss_fn)
        engine.optim.reduce_grads()
        _gather_reduced_shards(engine.optim.model)
        full = gather_full(engine.module, engine.groups, engine.spec, grads=True)
        engine.optimizer_zero_grad()
    return out["metrics"], {n: g for n, g in full.items() if ".router." in n}


def _gather_reduced_shards(ddp) -> None:
    """DDP with the distributed optimizer reduce-scatters each bucket: a DP rank holds only
    its shard of the reduced gradient. Gather the shards, so main_grad is the reduced
    gradient on every rank."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        size = group.intra_distributed_optimizer_instance_size
        if size == 1:
            continue
        for bucket in group.buckets:
            shards = shard_buffer(bucket.grad_data, size)
            mine = shards[group.intra_distributed_optimizer_instance_rank].clone()
            dist.all_gather(
                list(shards), mine, group=group.intra_distributed_optimizer_instance_group
            )


def padded_tokens(data) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's batch as right-padded ids [B, S] and the aux loss's tokens (its responses)."""
    rows = data["input_ids"].unbind()
    lengths_B = torch.tensor([len(r) for r in rows])
    ids_BS = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)
    pos_S = torch.arange(ids_BS.shape[1])
    start_B = lengths_B - batches.response_lengths_B(data)
    return ids_BS, (pos_S >= start_B[:, None]) & (pos_S < lengths_B[:, None])


def reference(world1, hf_dir, kind: str, data) -> tuple[dict, dict[str, torch.Tensor]]:
    """reference_step's (per-layer (balance, z) values, router gradients) of the whole batch
    on a fresh world-1 model with the checkpoint's weights (one micro-batch: sequence and
    global_batch do not depend on the split)."""
    ids_BS, valid_BS = padded_tokens(data)
    model = _tiny_mcore(world1, hf_dir)
    values, grads = reference_step(model, world1, kind, ids_BS, valid_BS, [ids_BS.shape[0]])
    return values, {n: g for n, g in grads.items() if ".router." in n}


def assert_aux_gradient(on, off, ref, where: str = "", dp: int = 1) -> None:
    """on, off: reduced_router_grads of aux on / off; ref: reference(). The backward carried
    the aux gradient at scale dp (megatron-core's DDP averages over DP)."""
    (metrics, grads_on), (_, grads_off), (ref_values, ref_grads) = on, off, ref
    # the gradient first: the headline, whatever the metrics say
    assert grads_on.keys() == ref_grads.keys() and ref_grads, where
    for name, expected in ref_grads.items():
        aux = grads_on[name] - grads_off[name]
        torch.testing.assert_close(
            aux, expected, rtol=1e-4, atol=1e-8, msg=lambda m, n=name: f"{where} {n}: {m}"
        )
    for layer, (lb, z) in ref_values.items():
        for name, value in (("load_balancing", lb), ("z_loss", z)):
            got = metrics[f"moe/aux_loss/{name}/layer_{layer}"][0]
            assert abs(got - value) <= 1e-5 * abs(value), f"{where} {name} layer {layer}"
    assert metrics["moe/aux_loss/grad_scale"] == [float(dp)], where
