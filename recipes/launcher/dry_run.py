"""The resolved run as the launcher prints it: the dry run's report, every launch's log header.

Plan, the local run's model, memory verdict (with the actor update at the assumed EP skew), rank layout with its
notes and warnings, traffic besides forward and backward, the device stack, what routing
replay needs from the rollout, which Ray, the job environment and the verl overrides by group.
"""

from backend.shared.names import DEVICE_LABELS
from recipes.dapo import BACKEND
from recipes.dapo.job import overrides
from recipes.launcher import stack

RUN_LABELS = {**DEVICE_LABELS, "cpu": f"{DEVICE_LABELS['cpu']} (small Qwen3-MoE)"}
R3_ROLLOUT = {
    "cuda": "vLLM >= 0.22 (enable_return_routed_experts); the cuda set has vllm 0.24.0",
    "npu": "vLLM >= 0.22 with a vllm-ascend built for it; per A2 set: the stack lines above",
    "cpu": (
        "vLLM's CPU build returns them (recipes/local/cpu/vllm_layers.py reports the CPU MoE "
        "kernel's experts)"
    ),
}


def describe(resolved) -> str:
    """The report of a recipes.launcher.resolution.Resolved (its `describe()`)."""
    run = resolved.run
    ours = run.engine == overrides.BACKEND
    actor = "mcore_ep actor" if ours else "verl's FSDP2 actor (--engine fsdp)"
    lines = [
        f"DAPO, verl 0.9.1 V1 trainer, {actor} on {RUN_LABELS[run.device]} x {run.plan.world}",
        f"plan: {run.plan.describe()}" if ours else
        f"plan: FSDP2 over all {run.plan.world} ranks (parameters, gradients and optimizer "
        "state sharded; no TP/EP/PP): the side by side (docs/ab_engines.md)",
    ]  # fmt: skip
    if getattr(resolved, "model_line", ""):  # the local run: the model it trains
        lines.append(resolved.model_line)
    lines += mode_lines(resolved)
    if resolved.model_fit is not None and ours:  # the memory model: ours, on accelerators
        lines += ["memory (parallel/ model):", *[f"  {line}" for line in run.fit.lines()]]
        lines += [f"  {line}" for line in resolved.skew_lines]
        lines += layout_and_warnings(resolved.model_fit, run.plan)
        lines += ["traffic besides forward and backward (parallel/):"]
        lines += [f"  {line}" for line in traffic_lines(resolved)]
    lines += stack.describe(run.device)  # npu: which A2 set is installed, R3 there
    lines += replay_lines(resolved.groups, run.device) if ours else []
    lines.append(f"Ray: {ray_line(run)}")
    lines += ["environment (this process and every Ray worker):"]
    lines += [f"  {k}={v}" for k, v in run.env.items()]
    if resolved.replaced:
        lines.append(f"replaced by pass-through overrides: {', '.join(resolved.replaced)}")
    for group, values in resolved.groups.items():
        lines.append(f"[{group}]")
        lines += [f"  {item}" for item in overrides.to_cli({group: values})]
    lines.append("command: " + " ".join(resolved.command[:3]) + " <the overrides above>")
    return "\n".join(lines)


def mode_lines(resolved) -> list[str]:
    """verl's trainer mode: what it sets, and separate_async's devices (trainer_modes)."""
    from recipes.dapo.job import trainer_modes

    run = resolved.run
    values = {
        "sync_step": overrides.value_of(resolved.groups, trainer_modes.SYNC_STEP),
        "bypass_mode": overrides.value_of(resolved.groups, trainer_modes.BYPASS),
        "rollout_is": overrides.value_of(resolved.groups, trainer_modes.ROLLOUT_IS),
    }
    sp = trainer_modes.run_split(run)
    lines = trainer_modes.describe(run.trainer_mode, run.device, sp, values)
    if sp.rollout_nodes and resolved.model_fit is not None:  # a cluster's rollout devices
        lines += trainer_modes.rollout_side_lines(run.fit, overrides.DAPO["rollout_tp"], sp)
    return lines


def traffic_lines(resolved) -> list[str]:
    """Routes per batch, the checkpoint per save, one weight sync (the DAPO settings)."""
    from parallel.traffic import route_lines, save_size
    from parallel.weight_sync import DEFAULT_BUCKET_MB, LINKS, sync_cost

    spec, plan, dapo = resolved.model_fit.spec, resolved.run.plan, overrides.DAPO
    samples = [dapo[k] * dapo["n"] for k in ("train_batch_size", "gen_batch_size")]
    lines = route_lines(spec, *samples, overrides.MEAN_SAMPLE_TOKENS, plan.pp)
    every = overrides.value_of(resolved.groups, "trainer.save_freq")
    lines += save_size(spec, plan.world).lines(int(every))
    mb = overrides.value_of(
        resolved.groups, f"actor_rollout_ref.actor.{BACKEND}.weight_sync_bucket_mb"
    )
    bucket = int(float(DEFAULT_BUCKET_MB if mb is None else mb) * 2**20)
    links = LINKS[resolved.run.device]
    return lines + sync_cost(spec, plan, bucket, links).lines(links, bucket)


def layout_and_warnings(model_fit, plan) -> list[str]:
    """The ranks' layout, then the notes and warnings on it and on the experts' fit."""
    from parallel.advice import cross_node_warnings, expert_notes, expert_warnings, listed
    from parallel.rank_layout import RankLayout
    from parallel.report import layout_summary

    layout = RankLayout(plan)
    tokens = overrides.MICRO_BATCH_TOKENS
    warnings = cross_node_warnings(layout) + expert_warnings(model_fit, tokens)
    return [
        layout_summary(layout),
        *listed("notes", expert_notes(model_fit, tokens)),
        *listed("warnings", warnings),
    ]


def assumed_skew_lines(model_fit, fit, skew) -> tuple[str, ...]:
    """The actor update at the assumed EP skew (report, or the default), and the skew margin."""
    from parallel.memory import MemoryOptions
    from parallel.skew import skew_lines

    options = MemoryOptions(
        fit.device_gib,
        overrides.MICRO_BATCH_TOKENS,
        recompute=fit.recompute,
        offload_params=fit.param_offload,
        offload_optimizer=fit.optimizer_offload,
    )
    return tuple(skew_lines(model_fit, options, skew))


def ray_line(run: overrides.JobSpec) -> str:
    if run.ray_address:
        return f"the running cluster at {run.ray_address} (--ray-address)"
    if run.device == "cpu":
        return "a new one, started by verl's ray.init() for this run (the embedded run)"
    return "the running cluster Ray finds from this node (ray status; --ray-address to name it)"


def replay_lines(groups: dict[str, dict], device: str) -> list[str]:
    """What routing replay needs from the rollout (printed by the dry run)."""
    mode = str(
        overrides.value_of(groups, f"actor_rollout_ref.actor.{BACKEND}.router_replay") or "disabled"
    )
    if mode == "disabled":
        return []
    lines = [f"routing replay: {mode} (docs/routing_replay.md)"]
    key = "actor_rollout_ref.rollout.enable_rollout_routing_replay"
    on = str(overrides.value_of(groups, key)).lower() == "true"
    if mode == "R3":
        source = R3_ROLLOUT[device]
        lines.append(f"  R3 needs the rollout's routed_experts: {source}")
        if not on:
            lines.append(f"  warning: set {key}=True, or the first step stops without routes")
    elif on:
        lines.append(f"  warning: R2 records its own routes: verl refuses {key}=True with R2")
    return lines
