"""AuxLossConfig: what the router aux-loss hook computes and whether it adds a gradient.

Validated as a whole, so that a setting with no effect is an error, never a silent no-op
(verl's Megatron engine forces moe_router_load_balancing_type="none", so a bare
moe_aux_loss_coeff there does nothing). The coefficient is never taken from the HF
checkpoint (`router_aux_loss_coef`): it is set here or nowhere.
"""

from dataclasses import dataclass

MODES = ("off", "observe", "on")
TYPES = ("none", "micro_batch", "sequence", "global_batch")
SCOPES = ("all", "response")
GLOBAL_COUNTS = ("counting_pass", "old_log_prob")


class AuxLossConfigError(ValueError):
    """The aux-loss settings contradict each other or name an unknown option."""


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise AuxLossConfigError(
            f"aux_loss.{name}={value!r} is unknown: choose one of {', '.join(options)}"
        )


@dataclass(frozen=True)
class AuxLossConfig:
    """mode: off | observe (computed and logged, no gradient) | on (gradient added).

    type: load-balancing loss level, none | micro_batch | sequence | global_batch.
    coeff: weight of each layer's balancing loss (summed over layers, as megatron-core does);
    Qwen3's released config uses 0.001. z_coeff: weight of each layer's router z-loss.
    scope: tokens that count, all (non-padding) | response (response tokens only).
    global_counts: where global_batch's f_i = C_i / (k * N) comes from when mode is on.
      counting_pass: the optimizer step's batch at the update's weights, counted by an extra
        no-grad forward before the first backward (exact; +1 forward per optimizer step).
      old_log_prob: the trainer step's batch as routed in the old-log-prob forward that
        verl runs anyway, C_i and N summed over all its micro-batches and ranks. Mini-batch
        j of m then minimises E * sum_i f_i(theta_old, whole batch) * P_i(theta_j, batch j):
        equal to counting_pass for j = 1 when m = 1 (theta_1 = theta_old, same tokens), and
        otherwise counts stale by j - 1 optimizer updates and taken over all m mini-batches.
    """

    mode: str = "off"
    type: str = "none"
    coeff: float = 0.0
    z_coeff: float = 0.0
    scope: str = "all"
    global_counts: str = "counting_pass"

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES)
        _choice("type", self.type, TYPES)
        _choice("scope", self.scope, SCOPES)
        _choice("global_counts", self.global_counts, GLOBAL_COUNTS)
        if self.counts_from_old_log_prob and not (
            self.mode == "on" and self.type == "global_batch"
        ):
            raise AuxLossConfigError(
                f"aux_loss.global_counts='old_log_prob' has no effect with mode={self.mode!r}, "
                f"type={self.type!r}: use it with mode='on', type='global_batch'"
            )
        for name in ("coeff", "z_coeff"):
            if getattr(self, name) < 0:
                raise AuxLossConfigError(
                    f"aux_loss.{name}={getattr(self, name)} is negative: use a value >= 0"
                )
        if self.mode == "off":
            if self.type != "none" or self.coeff or self.z_coeff:
                raise AuxLossConfigError(
                    f"aux_loss.mode='off' ignores type={self.type!r}, coeff={self.coeff}, "
                    f"z_coeff={self.z_coeff}: set mode='on' (or 'observe'), or clear them"
                )
            return
        if self.type == "none" and self.coeff:
            raise AuxLossConfigError(
                f"aux_loss.coeff={self.coeff} has no effect with type='none': "
                "set type to micro_batch, sequence or global_batch, or coeff=0"
            )
        if self.type != "none" and not self.coeff:
            raise AuxLossConfigError(
                f"aux_loss.type={self.type!r} needs coeff > 0: "
                "set coeff (Qwen3 used 0.001) or type='none'"
            )
        if self.type == "none" and not self.z_coeff:
            raise AuxLossConfigError(
                f"aux_loss.mode={self.mode!r} has nothing to compute: set type and coeff, "
                "or z_coeff, or mode='off'"
            )

    @property
    def active(self) -> bool:
        return self.mode != "off"

    @property
    def adds_gradient(self) -> bool:
        return self.mode == "on"

    @property
    def counts_from_old_log_prob(self) -> bool:
        return self.global_counts == "old_log_prob"

    @property
    def needs_counting_pass(self) -> bool:
        """global_batch with a gradient needs the step's routing counts before any backward:
        from a counting pass unless the old-log-prob pass gives them."""
        return (
            self.adds_gradient and self.type == "global_batch" and not self.counts_from_old_log_prob
        )

    def describe(self) -> str:
        """One line for the startup log, so the setting is visible in every run."""
        if not self.active:
            return "router aux loss: off"
        parts = [f"router aux loss: {self.mode}"]
        if self.type != "none":
            parts.append(f"balance {self.type} coeff={self.coeff:g}")
        if self.counts_from_old_log_prob:
            parts.append("f from the old-log-prob pass")
        if self.z_coeff:
            parts.append(f"z-loss coeff={self.z_coeff:g}")
        parts.append(f"tokens={self.scope}")
        return ", ".join(parts)
