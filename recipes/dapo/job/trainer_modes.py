"""verl's V1 trainer modes with our engine: `--trainer-mode sync|colocate_async|separate_async`.

- sync (the default): generate, then train, on the same devices.
- colocate_async: the same devices; partial rollouts continue across a weight update, so a
  step trains on tokens up to a few weight versions old (verl's trainer_colocate_async.py).
- separate_async: the rollout runs on devices of its own and never waits for the trainer; the
  trainer's weights reach it through a weight channel after every step: hccl on npu, nccl on
  cuda, our gloo channel on cpu (recipes.dapo.engine.weight_channel). verl asserts that a step is
  `parameter_sync_step` mini-batches (trainer_separate_async.py:59).

What separate_async changes for our engine: verl recomputes the old log-probs of a sync
cycle's later mini-batches with the weights that started it ("decoupled" PPO), saving and
restoring them through its DetachActorWorker, which knows verl's own strategies only. With
mcore_ep the run names verl's trainer `mcore_separate_async` (recipes.dapo.engine.decoupled:
verl's separate_async trainer registered under that name, its actor workers answering the
save / restore for our engine), whose config section aliases `trainer.v1.separate_async`.
Other engines keep verl's bypass mode (old log-probs = the rollout's), in which R2 cannot run
(its routes come from the skipped pass). The aux loss counts f in its own counting pass
(the old-log-prob pass runs on pi_old's weights in decoupled mode).

The rollout correction: both async modes turn on verl's token-level TIS (weights truncated
at 2) on the decoupled old log-probs; in bypass mode it is PPO's clipped ratio to the
rollout's own log-probs (verl's V1 trainer applies IS weights only in decoupled mode, so TIS
would be inert there and is not set).
"""

from dataclasses import dataclass

from recipes.dapo.errors import LaunchError

MODES = ("sync", "colocate_async", "separate_async")
CHANNELS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
CPU_CHANNEL_MODULE = "recipes.dapo.engine.weight_channel"
TIS = {"rollout_is": "token", "rollout_is_threshold": 2.0}
R = "actor_rollout_ref.rollout"
# the seed's A2 DAPO step on Qwen3-30B-A3B, verl's FSDP actor, 4 x 8 devices (s): the phases
# the dry run's estimate splits (the rest of its 310.6 s step is bookkeeping)
SEED_STEP_S = 310.6
SEED_PHASES_S = {"gen": 161.7, "update": 130.1, "old_log_prob": 16.4, "reshard": 10.9}
SYNC_STEP = "trainer.v1.separate_async.parameter_sync_step"
# recipes.dapo.engine.decoupled (not imported here: it imports verl's trainers)
DECOUPLED_MODE = "mcore_separate_async"
DECOUPLED_MODULE = "recipes.dapo.engine.decoupled"
MODULES_ENV = "VERL_USE_EXTERNAL_MODULES"
BYPASS = "algorithm.rollout_correction.bypass_mode"
ROLLOUT_IS = "algorithm.rollout_correction.rollout_is"


@dataclass(frozen=True)
class Split:
    """Whole nodes for each side of separate_async (sync and colocate_async: rollout 0)."""

    trainer_nodes: int
    rollout_nodes: int
    devices_per_node: int

    @property
    def rollout_devices(self) -> int:
        return self.rollout_nodes * self.devices_per_node


def split(mode: str, nodes: int, devices_per_node: int, embedded: bool = False) -> Split:
    """separate_async on a cluster (a CPU one too) gives the rollout half the nodes (rounded
    down); the embedded CPU run adds one rollout device (one vLLM engine) beside the trainer's."""
    if mode != "separate_async":
        return Split(nodes, 0, devices_per_node)
    if embedded:
        return Split(nodes, 1, 1)
    if nodes < 2:
        raise LaunchError(
            f"--trainer-mode separate_async needs whole nodes for the rollout and the trainer: "
            f"--nodes {nodes} has one; use --nodes 2 or more, or --trainer-mode colocate_async"
        )
    return Split(nodes - nodes // 2, nodes // 2, devices_per_node)


def run_split(run) -> Split:
    """The split a JobSpec (recipes.dapo.job.overrides) was resolved with."""
    embedded = run.device == "cpu" and not run.ray_address
    per_node = 1 if embedded and run.rollout_nodes else run.plan.devices_per_node
    return Split(run.plan.nodes, run.rollout_nodes, per_node)


def decoupled(mode: str, engine: str) -> bool:
    """separate_async with our engine: verl's decoupled PPO through mcore_separate_async."""
    from recipes.dapo import BACKEND

    return mode == "separate_async" and engine == BACKEND


def verl_mode(mode: str, engine: str) -> str:
    """The name verl's trainer registry is asked for (trainer.v1.trainer_mode)."""
    return DECOUPLED_MODE if decoupled(mode, engine) else mode


def external_modules(existing: str | None) -> str:
    """VERL_USE_EXTERNAL_MODULES with the decoupled trainer's module added: verl imports them
    in every process, the TaskRunner included, before it looks the trainer up."""
    modules = [m for m in (existing or "").split(",") if m]
    return ",".join([*modules, DECOUPLED_MODULE])


def overrides(
    mode: str, device: str, sp: Split, train_batch: int, mini_batch: int, engine: str
) -> dict:
    """What the mode needs in verl's config besides trainer.v1.trainer_mode (the trainer
    group sets it) and the job's environment: nothing for sync."""
    tis = {f"algorithm.rollout_correction.{k}": v for k, v in TIS.items()}
    if mode == "sync":
        return {}
    if mode == "colocate_async":
        return tis
    values = {
        SYNC_STEP: sync_step(train_batch, mini_batch),
        f"{R}.nnodes": sp.rollout_nodes,
        f"{R}.n_gpus_per_node": sp.devices_per_node,
        f"{R}.checkpoint_engine.backend": CHANNELS[device],
        BYPASS: not decoupled(mode, engine),
    }  # fmt: skip
    if decoupled(mode, engine):
        values.update(tis)
        values[f"+trainer.v1.{DECOUPLED_MODE}"] = "${trainer.v1.separate_async}"
    if device == "cpu":
        values[f"{R}.checkpoint_engine.custom_backend_module"] = CPU_CHANNEL_MODULE
    return values


def sync_step(train_batch: int, mini_batch: int) -> int:
    """verl's separate_async asserts train_batch_size == parameter_sync_step * mini-batch."""
    if train_batch % mini_batch:
        raise LaunchError(
            f"separate_async trains a step as whole mini-batches: train_batch_size {train_batch} "
            f"is not a multiple of ppo_mini_batch_size {mini_batch}; make it one"
        )
    return train_batch // mini_batch


def check_values(mode: str, values: dict) -> None:
    """After pass-through overrides: combinations verl or our engine refuse later, in one line.
    values: config path -> value (recipes.dapo.job.overrides.value_of)."""
    replay = str(values.get("router_replay") or "disabled")
    bypass = str(values.get("bypass_mode")).lower() == "true"
    if mode == "separate_async" and replay == "R2" and bypass:
        raise LaunchError(
            "router_replay R2 records routes in the old-log-prob pass, which separate_async "
            "skips in bypass mode: drop algorithm.rollout_correction.bypass_mode=true "
            "(decoupled PPO runs the pass), use R3 or --trainer-mode colocate_async"
        )
    if mode != "separate_async":
        return
    train, mini, step = values["train_batch"], values["mini_batch"], values["sync_step"]
    if int(train) != int(step) * int(mini):
        raise LaunchError(
            f"separate_async: train_batch_size {train} != parameter_sync_step {step} x "
            f"ppo_mini_batch_size {mini} (verl asserts it): set {SYNC_STEP}={int(train) // int(mini)}"
        )


def rollout_side_lines(fit, rollout_tp: int, sp: Split) -> list[str]:
    """separate_async's rollout devices hold vLLM alone: its weights and context, the rest KV.
    (The trainer's devices keep verl's hybrid replicas, which validate: the colocated memory
    check above is theirs.) fit: recipes.dapo.job.fit.Fit."""
    from recipes.dapo.job.fit import MIN_KV_CACHE_GIB

    kv = fit.limit_gib - fit.context_gib - fit.rollout_weights_gib
    if kv < MIN_KV_CACHE_GIB:
        raise LaunchError(
            f"separate_async: vLLM weights {fit.rollout_weights_gib:.1f} GiB per device at "
            f"rollout TP {rollout_tp} leave {kv:.1f} GiB of KV cache (>= {MIN_KV_CACHE_GIB:g} "
            "needed): raise the rollout TP"
        )
    engines = sp.rollout_devices // rollout_tp
    return [
        f"  rollout devices: {engines} vLLM engines of TP {rollout_tp}; per device vLLM weights "
        f"{fit.rollout_weights_gib:.1f} GiB + context {fit.context_gib:.2f} GiB -> KV cache "
        f"{kv:.1f} GiB of {fit.limit_gib:.1f} usable (nothing of the actor)"
    ]


def describe(mode: str, device: str, sp: Split, values: dict) -> list[str]:
    """The dry run's lines for the mode."""
    if mode == "sync":
        return ["trainer mode: sync (generate, then train, on the same devices)"]
    bypass = str(values.get("bypass_mode")).lower() == "true"
    tis = f"TIS (token, weights <= {TIS['rollout_is_threshold']:g})"
    if values.get("rollout_is", TIS["rollout_is"]) in (None, "null", "None"):
        tis = "none (rollout_is=null: PPO's ratio to the recomputed old log-probs alone)"
    clip = "PPO's clip on the ratio to the rollout's log-probs (bypass)"
    lines = [f"trainer mode: {mode}, rollout correction {clip if bypass else tis}"]
    if mode == "separate_async":
        old = (
            "the rollout's (verl's bypass mode)"
            if bypass
            else "recomputed with the cycle's first weights (decoupled PPO, one host copy)"
        )
        lines.append(
            f"  devices: trainer {sp.trainer_nodes} x {sp.devices_per_node}, rollout "
            f"{sp.rollout_nodes} x {sp.devices_per_node} (its own vLLM engines); weights over "
            f"{CHANNELS[device]} after every step ({values['sync_step']} mini-batch updates); "
            f"old log-probs: {old}"
        )
    return lines + estimate_lines(mode, sp)


def estimate_lines(mode: str, sp: Split) -> list[str]:
    """What the mode could give by phase arithmetic on the seed's A2 step (same devices in
    all): separate_async overlaps generation with the rest, each on its share of devices."""
    p = SEED_PHASES_S
    train = p["update"] + p["old_log_prob"] + p["reshard"]
    if mode == "colocate_async":
        return [
            f"  estimate (seed's A2 step {SEED_STEP_S:g} s): the same phases on the same devices, "
            "so no overlap by phase arithmetic; the gain is the long tail of generation that "
            "partial rollouts no longer wait for (not in these phase times)"
        ]
    if mode != "separate_async":
        return []
    total = sp.trainer_nodes + sp.rollout_nodes
    gen = p["gen"] * total / sp.rollout_nodes
    rest = train * total / sp.trainer_nodes
    step = max(gen, rest)
    return [
        f"  estimate (seed's A2 step {SEED_STEP_S:g} s: gen {p['gen']:g} + update, old-log-prob "
        f"and reshard {train:.1f}): full overlap on all devices bounds it at "
        f"{max(p['gen'], train):.1f} s ({SEED_STEP_S / max(p['gen'], train):.2f}x); on this split "
        f"each side has {sp.rollout_nodes}/{total} and {sp.trainer_nodes}/{total} of the devices: "
        f"max(gen {gen:.1f}, train {rest:.1f}) = {step:.1f} s ({SEED_STEP_S / step:.2f}x); the "
        "long tail of generation, which the phases do not show, is where it gains"
    ]
