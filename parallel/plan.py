"""A parallel plan (tp, pp, vpp, cp, ep, etp over nodes x devices) and its legality checks.

megatron-core folds the same world twice (MoE parallel folding):
  attention/dense layers: tp * cp * dp  * pp = world
  expert layers:          etp * ep * edp * pp = world   (same pp groups)
so dp and edp are derived, and only the folding divisibility is checked here. What the
model itself requires (heads, experts, layers, vocab) is `check_against_model`.
"""

from dataclasses import dataclass, fields
from math import lcm

from backend.qwen3_moe import Qwen3MoeSpec
from backend.shared.integers import round_up

# megatron-core pads the vocab to a multiple of make_vocab_size_divisible_by * tp
VOCAB_DIVISIBLE_BY = 128


class PlanError(ValueError):
    """A plan that megatron-core or the model cannot run; the message names the fix."""


def divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values))


@dataclass(frozen=True)
class ParallelPlan:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int | None = None
    nodes: int = 1
    devices_per_node: int = 8
    # uneven pipelines: layers on the first / last stage (the rest split evenly)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:  # optional and unset
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{f.name}={value!r} must be a positive integer")
        self._check_folding("tp*cp*pp", self.tp * self.cp * self.pp, "tp*cp*dp*pp")
        self._check_folding("etp*ep*pp", self.etp * self.ep * self.pp, "etp*ep*edp*pp")
        if self.vpp is not None and self.pp == 1:
            raise PlanError(
                f"vpp={self.vpp} needs pp > 1: interleaving splits pipeline stages; "
                "drop --vpp or raise --pp"
            )
        if self.pp == 1 and (self.first_stage_layers or self.last_stage_layers):
            raise PlanError("first/last stage layer counts need pp > 1: drop them or raise --pp")

    def _check_folding(self, label: str, size: int, folding: str) -> None:
        if self.world % size:
            raise PlanError(
                f"{label}={size} does not divide world={self.world} "
                f"({self.nodes} nodes x {self.devices_per_node}): {folding} must equal world; "
                f"legal {label}: {_listed(divisors(self.world))}"
            )

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def dp(self) -> int:
        """Attention data-parallel size (context parallel folded out, as megatron's dp group)."""
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size: replicas of each expert shard."""
        return self.world // (self.etp * self.ep * self.pp)

    @classmethod
    def for_world(cls, world: int, **dims: int) -> "ParallelPlan":
        """The plan of `world` ranks seen as one node (what a running job knows)."""
        return cls(nodes=1, devices_per_node=world, **dims)

    def record(self) -> dict[str, int]:
        """The sizes a checkpoint records (meta.json "plan"): resume needs the same."""
        return dict(tp=self.tp, ep=self.ep, etp=self.etp, pp=self.pp, cp=self.cp, dp=self.dp,
                    world=self.world)  # fmt: skip

    def describe(self) -> str:
        vpp = f" vpp={self.vpp}" if self.vpp else ""
        return (
            f"tp={self.tp} pp={self.pp}{vpp} cp={self.cp} ep={self.ep} etp={self.etp} "
            f"dp={self.dp} edp={self.edp} on {self.nodes}x{self.devices_per_node}="
            f"{self.world} devices"
        )


@dataclass(frozen=True)
class ModelFit:
    """What a legal plan implies for a model."""

    plan: ParallelPlan
    spec: Qwen3MoeSpec
    sequence_parallel: bool
    padded_vocab: int
    stage_layers: tuple[int, ...]  # decoder layers held by each pipeline stage
    experts_per_rank: int


def _check_heads(plan: ParallelPlan, spec: Qwen3MoeSpec) -> None:
    legal = [d for d in divisors(spec.num_kv_heads) if spec.num_heads % d == 0]
    for field, count in (
        ("num_key_value_heads", spec.num_kv_heads),
        ("num_attention_heads", spec.num_heads),
    ):
        if count % plan.tp:
            raise PlanError(
                f"tp={plan.tp} does not divide {field}={count}: "
                f"legal tp for this model: {_listed(legal)}"
            )


def _check_experts(plan: ParallelPlan, spec: Qwen3MoeSpec) -> None:
    if spec.num_experts % plan.ep:
        raise PlanError(
            f"ep={plan.ep} does not divide num_experts={spec.num_experts}: "
            f"legal ep for this model: {_listed(divisors(spec.num_experts))}"
        )
    if spec.moe_ffn_hidden_size % plan.etp:
        legal = divisors(spec.moe_ffn_hidden_size, limit=plan.world)
        raise PlanError(
            f"etp={plan.etp} does not divide moe_intermediate_size="
            f"{spec.moe_ffn_hidden_size}: legal etp for this model: {_listed(legal)}"
        )


def _even_stage_layers(plan: ParallelPlan, num_layers: int) -> tuple[int, ...]:
    chunks = plan.pp * (plan.vpp or 1)
    if num_layers % chunks:
        label = "pp*vpp" if plan.vpp else "pp"
        legal = _listed(divisors(num_layers))
        raise PlanError(
            f"{label}={chunks} does not divide num_hidden_layers={num_layers}: "
            f"legal {label} for this model: {legal} (or set first/last stage layers)"
        )
    return (num_layers // plan.pp,) * plan.pp


def _uneven_stage_layers(plan: ParallelPlan, num_layers: int) -> tuple[int, ...]:
    if plan.vpp:
        raise PlanError(
            "uneven first/last stages with vpp are not planned here: "
            "drop --vpp or the stage layer counts"
        )
    first, last = plan.first_stage_layers, plan.last_stage_layers
    free_stages = plan.pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < free_stages or (free_stages == 0 and rest) or (free_stages and rest % free_stages):
        raise PlanError(
            f"first={first} / last={last} stage layers leave {rest} of num_hidden_layers="
            f"{num_layers} for {free_stages} other stages: they must split it evenly, "
            "at least one layer each"
        )
    middle = rest // free_stages if free_stages else 0
    layers = [middle] * plan.pp
    if first is not None:
        layers[0] = first
    if last is not None:
        layers[-1] = last
    return tuple(layers)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tp
    return round_up(vocab_size, multiple)


def plan_for_model(
    spec: Qwen3MoeSpec, nodes: int = 1, devices_per_node: int = 8, **dims
) -> ModelFit:
    """check_against_model of the plan `dims` on nodes x devices_per_node, where a dimension
    the model itself cannot take is refused for that reason (ep=3: 128 experts; pp=5: 48
    layers) before the world-size folding is checked."""
    try:  # the same dims on a world where the folding holds: only the model can refuse them
        size = {d: dims.get(d) or 1 for d in ("tp", "cp", "pp", "ep", "etp")}
        world = lcm(size["tp"] * size["cp"] * size["pp"], size["etp"] * size["ep"] * size["pp"])
        probe = ParallelPlan(nodes=1, devices_per_node=world, **dims)
    except (PlanError, TypeError):
        probe = None  # not positive integers: the real plan below says so
    if probe is not None:
        check_against_model(probe, spec)
    return check_against_model(
        ParallelPlan(nodes=nodes, devices_per_node=devices_per_node, **dims), spec
    )


def check_against_model(plan: ParallelPlan, spec: Qwen3MoeSpec) -> ModelFit:
    """Every model constraint on the plan; raises PlanError naming the first one broken."""
    _check_heads(plan, spec)
    _check_experts(plan, spec)
    uneven = plan.first_stage_layers is not None or plan.last_stage_layers is not None
    stage_layers = (_uneven_stage_layers if uneven else _even_stage_layers)(plan, spec.num_layers)
    return ModelFit(
        plan=plan,
        spec=spec,
        # megatron-core requires sequence parallel for MoE layers when tp > 1
        sequence_parallel=plan.tp > 1,
        padded_vocab=padded_vocab_size(spec.vocab_size, plan.tp),
        stage_layers=stage_layers,
        experts_per_rank=spec.num_experts // plan.ep,
    )
