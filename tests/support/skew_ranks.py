"""Rank function for the EP-skew test (module level: spawn imports it by name).

Routing is forced by a forward hook on every router, ahead of the RouterTap's: "skewed" sends
each token to the first top_k experts (all on EP rank 0), "balanced" sends token t to local
expert t % (E/ep) of every EP rank (top_k == ep in the tiny model), so both ranks get T*k/ep*ep.
"""

import torch

from tests.support.multiproc import job_plan

TOKENS = 64


def _forced(mode: str, num_experts: int, ep: int):
    def hook(router, args, output):
        probs_TE, routing_TE = output
        tokens, top_k = routing_TE.shape[0], int(routing_TE[0].sum())
        local = num_experts // ep
        if mode == "skewed":
            experts_TK = torch.arange(top_k).expand(tokens, top_k)
        else:
            first_T = torch.arange(tokens) % local
            experts_TK = first_T[:, None] + local * torch.arange(top_k)[None, :]
        routing = torch.zeros_like(routing_TE).scatter_(1, experts_TK, True)
        # keep the probs differentiable: each token's kept mass, spread over its k experts
        probs = routing * (probs_TE.sum(-1, keepdim=True) / top_k)
        return probs, routing

    return hook


def skewed_and_balanced(rank: int, assumed_skew: float) -> dict:
    """Saved bytes of the decoder layers, and the SkewGuard's warnings, for both routings."""
    from backend.platform.device import prepare_device

    device = prepare_device("cpu")
    from backend.instruments.router_tap import RouterTap, router_modules
    from backend.model.build import BuildOptions, build_model
    from backend.model.forward import forward_logits
    from backend.monitor import ExpertLoadMonitor, SkewGuard
    from backend.qwen3_moe import load_qwen3_moe_spec
    from backend.training.distributed import init_parallel
    from recipes.local.task.hf_checkpoints import tiny_config
    from tests.support.activation_measure import saved_bytes_inside

    groups = init_parallel(device, job_plan(ep=2))
    spec = load_qwen3_moe_spec(tiny_config())
    torch.manual_seed(0)
    options = BuildOptions(device="cpu", experts="grouped", attention="sdpa")
    model = build_model(spec, groups, options)
    ids = torch.randint(
        0, spec.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(rank)
    )
    out = {}
    for step, mode in enumerate(("skewed", "balanced")):
        hook = _forced(mode, spec.num_experts, groups.size("ep"))
        handles = [r.register_forward_hook(hook, prepend=True) for r in router_modules(model)]
        tap = RouterTap(model, groups)
        guard = SkewGuard(assumed_skew, every_n_steps=10)
        monitor = ExpertLoadMonitor(
            spec.num_layers, spec.num_experts, groups, top_k=spec.top_k, skew_guard=guard
        ).attach(tap)
        with (
            monitor.phase("update"),
            saved_bytes_inside(model, list(model.decoder.layers)) as saved,
        ):
            forward_logits(model, ids).float().pow(2).mean().backward()
        metrics = monitor.step_end(step)
        out[mode] = {
            "saved_bytes": saved.total,
            "warnings": [w.line() for w in monitor.warnings],
            "ep_skew_max": metrics["moe/update/ep_max_over_mean_max"],
        }
        tap.remove()
        for handle in handles:
            handle.remove()
    return out
