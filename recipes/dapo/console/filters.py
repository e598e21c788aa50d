"""What the launcher's console (recipes.dapo.console.screen) holds back, relabels and adds.

- NOT_APPLICABLE: library notices that say nothing about this run, each with its reason and
  the devices it holds for (None: every device). They go to the log only; the console says at
  the end how many it held back. A warning that could matter is not on the list: what is on
  it is a fact of the CPU stack (no NUMA library, no tcmalloc, no Triton, no IPC), a setting
  verl or the CPU recipe makes on purpose (eager mode, runtime LoRA updates, the generation
  config override), or a library's deprecation inside its own code.
- config lines: `mcore_ep: config: ...` (logged at INFO by the engine) shown once as
  `config: ...`, not as warnings.
- Startup: while nothing else shows (before the first step line), `starting: <phase> (N s)`
  once per phase (from STARTUP_EVERY_S after the launch), the phase read from the lines the
  console sees; a phase that lasts gets `  ... N s` every STILL_EVERY_S, its name not repeated.
"""

import re
from dataclasses import dataclass, field

STARTUP_EVERY_S = 15.0
STILL_EVERY_S = 60.0


@dataclass(frozen=True)
class Notice:
    """A library notice held back: its pattern, why, and on which devices (None: all)."""

    pattern: re.Pattern
    reason: str
    devices: tuple[str, ...] | None = ("cpu",)

    def applies(self, text: str, device: str | None) -> bool:
        on = self.devices is None or device in self.devices
        return on and self.pattern.search(text) is not None


def _n(pattern: str, reason: str, devices: tuple[str, ...] | None = ("cpu",)) -> Notice:
    return Notice(re.compile(pattern), reason, devices)


NOT_APPLICABLE = (
    _n(r"IPC is not supported on your devices", "no CUDA IPC on CPU: verl shares weights "
       "through shared memory, as intended there"),  # fmt: skip
    _n(r"Failed to set NUMA affinity: libnuma", "no libnuma on this box: CPU placement only"),
    _n(r"NUMA binding: Using MEMBIND policy", "vLLM's CPU worker binds to the one NUMA node"),
    _n(r"(?:libtcmalloc|libiomp) is not found in LD_PRELOAD", "vLLM's CPU speed tips; the "
       "tiny model does not need them"),  # fmt: skip
    _n(r"Failed to create oneDNN linear", "vLLM's CPU matmul falls back to torch, same results"),
    _n(r"Enforce eager set, disabling torch\.compile", "the CPU rollout runs eager on purpose"),
    _n(r"Inductor compilation was disabled", "follows from eager mode (the CPU rollout's)"),
    _n(r"Reset SSM cache type to float32 for accelerated GDN", "vLLM's CPU platform sets a "
       "cache type for Mamba-style layers; Qwen3-MoE has none"),  # fmt: skip
    _n(r"Model Runner V2 requires Triton", "no Triton on CPU: vLLM's V1 runner is the one used"),
    _n(r"LoRA dynamic loading & unloading is enabled", "verl's rollout server sets it; the "
       "server is private to the job", None),  # fmt: skip
    _n(r"Default vLLM sampling parameters have been overridden", "verl passes the sampling "
       "parameters of every request itself", None),  # fmt: skip
    _n(r"Passing raw prompts to InputProcessor is deprecated", "verl's call into vLLM, not "
       "this run's", None),  # fmt: skip
    _n(r"`Qwen2VLImageProcessor` requires torchvision", "transformers probes an image "
       "processor for a text-only model; the rollout reads text", None),  # fmt: skip
    _n(r"^(?:torch|megatron)/\S+\.py:\d+: (?:Future|Deprecation)Warning:", "a deprecation "
       "inside torch / megatron-core's own calls: a note for their code, not for the run", None),
    _n(r"^verl/trainer/ppo/v1/trainer_base\.py:\d+: FutureWarning: .*'verl\.utils\.import_utils"
       r"\.load_extern_type' is deprecated", "verl's builder loads the CPU run's replay buffer "
       "with its own deprecated loader: a note for verl's code", ("cpu",)),  # fmt: skip
)  # fmt: skip


def not_applicable(text: str, device: str | None) -> Notice | None:
    """The NOT_APPLICABLE notice a warning line is, on this device; None for the rest."""
    return next((n for n in NOT_APPLICABLE if n.applies(text, device)), None)


def held_back_line(count: int, device: str | None, log_path) -> str:
    """The console's one line for the notices it held back."""
    run = f"a {device.upper()} run" if device else "this run"
    return f"held back {count} library notices that do not apply to {run} (log: {log_path})"


CONFIG = re.compile(r"\bmcore_ep: config: (.*)$")


def config_text(text: str) -> str | None:
    """`config: ...` for the engine's configuration line; None for other lines."""
    m = CONFIG.search(text)
    return f"config: {m.group(1).strip()}" if m else None


FIRST_VALIDATION = "the first validation"  # the last start-up phase (the summary splits at it)
# (a line that starts the phase, the phase): the first matching, in the order they come
PHASES = (
    (re.compile(r"ray init kwargs|Connecting to existing Ray cluster"), "Ray"),
    (
        re.compile(r"Started a local Ray instance|Connected to Ray cluster"),
        "verl's driver and data",
    ),
    (re.compile(r"create worker group"), "the actor workers"),
    (re.compile(r"actor and ref model engine initialized"), "vLLM rollout"),
    (re.compile(r"all initialize finished"), FIRST_VALIDATION),
)


@dataclass
class Startup:
    """The start-up phase as the lines show it, and when to say it (module doc)."""

    started: float
    phase: str = "verl's trainer (imports)"
    said_at: float | None = None
    said_phase: str | None = None
    done: bool = False
    began: dict = field(default_factory=dict)  # phase -> clock seconds its first line came

    def observe(self, text: str, now: float | None = None) -> None:
        for pattern, phase in PHASES:
            if pattern.search(text):
                self.phase = phase
                self.began.setdefault(phase, now)

    def line(self, now: float) -> str | None:
        """The line due at `now` (clock seconds): a new phase's `starting: <phase> (N s)`, a
        lasting one's `  ... N s`; else None."""
        if self.done or now - self.started < STARTUP_EVERY_S:
            return None
        if self.phase != self.said_phase:
            self.said_at, self.said_phase = now, self.phase
            return f"starting: {self.phase} ({now - self.started:.0f} s)"
        if now - self.said_at < STILL_EVERY_S:
            return None
        self.said_at = now
        return f"  ... {now - self.started:.0f} s"
