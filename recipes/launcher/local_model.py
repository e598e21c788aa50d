"""The model a local run trains, chosen and checked before anything is written or started.

`--model` takes `mini` (the default), `tiny` (both built by the run, recipes.local.task.built_models) or
the directory of the user's own small HF Qwen3-MoE with its tokenizer, used in place (nothing
copied). A pass-through `-- actor_rollout_ref.model.path=DIR` is the same as `--model DIR`:
the same checks, and the finish exports against it; both naming different models is refused.
A directory is checked for what verl and vLLM's CPU backend read: config.json of model_type
qwen3_moe, safetensors weights, a tokenizer with a chat template (verl's dataloader applies
it to every prompt); recipes.launcher.local_checks then checks the plan and vLLM's CPU limits
against its config. Each problem: one line (LaunchError) naming it and the fix.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

from recipes.dapo.errors import LaunchError
from recipes.dapo.job import overrides
from recipes.local.task import built_models

MODEL_KEY = "actor_rollout_ref.model.path"
FLAG_HELP = (
    "the model to train: cluster run: the HF checkpoint dir of Qwen3-30B-A3B (config.json + "
    "safetensors); local run: mini (128 experts, top-8, from an SFT warm-up; the default), tiny "
    "(8 experts, top-2) "
    "or the dir of your own small HF Qwen3-MoE with its tokenizer and chat template "
    "(docs/cpu_run.md)"
)


@dataclass(frozen=True)
class LocalModel:
    name: str  # tiny | mini | the directory as given
    path: Path  # where verl reads it: <out>/<name>_hf for a built one, else the directory
    config: dict  # its config.json (a built one's in memory until it is written)
    built: bool  # made by the run (recipes.local.task.built_models.make_built)
    tokens: int | None = None  # a built one's tokenizer length before it is written
    task: str = "doubles"  # recipes.local.cpu_overrides.TASKS

    @property
    def warmed(self) -> bool:
        """RL starts from the SFT warm-up's export (recipes.local.warmup)."""
        return self.built and self.name in built_models.WARMED

    def describe(self) -> str:
        """The dry run's line naming the model."""
        c = self.config  # transformers 5 saves num_experts as num_local_experts
        experts = c.get("num_experts", c.get("num_local_experts"))
        shape = f"{experts} experts, top-{c.get('num_experts_per_tok')}"
        if self.warmed:
            return (f"model: {self.name} ({shape}; built, then an SFT warm-up on the {self.task} "
                    f"task, once, in {self.path})")  # fmt: skip
        if self.built:
            return f"model: {self.name} ({shape}; built once in {self.path})"
        return f"model: {self.path} ({shape}; your HF Qwen3-MoE, used in place)"


def choose(flag: str | None, extra: list[str], out: Path, task: str | None = None) -> LocalModel:
    """The model of `--model` and the pass-through overrides, with the `--task` it trains on
    (its default without one), checked (one line each)."""
    model = _chosen(flag, extra, out)
    if task is None or task == model.task:
        return model
    choices = built_models.TASK_CHOICES.get(model.name, ()) if model.built else ()
    if task not in choices:
        raise LaunchError(
            f"--task {task} is a task of --model mini (its SFT warm-up writes the task's "
            f"working), not of {model.name}: drop --task, or add --model mini"
        )
    return replace(model, task=task)


def _chosen(flag: str | None, extra: list[str], out: Path) -> LocalModel:
    passed = [i.split("=", 1)[1] for i in extra if "=" in i and overrides.key_of(i) == MODEL_KEY]
    given = Path(passed[-1]).expanduser() if passed else None
    if flag is not None and given is not None and _as_dir(flag) != given.absolute():
        raise LaunchError(
            f"--model {flag} and -- {MODEL_KEY}={passed[-1]} name different models: pass one "
            "(--model takes tiny, mini or a directory)"
        )
    if given is not None:
        return checked_dir(given, f"{MODEL_KEY}={passed[-1]}")
    name = flag or built_models.DEFAULT
    if name in built_models.BUILT:
        if built_models.shape(name) is None:
            raise LaunchError(
                f"--model {name}: this tree's parallel.models has no {built_models.SHAPE_NAMES[name]}, "
                f"so the {name} model is not available here: use --model tiny or a directory"
            )
        path = built_models.rl_dir(out, name)
        config = built_models.built_config(name)
        if (path / "config.json").is_file():  # made by an earlier launch in this directory
            config = json.loads((path / "config.json").read_text())
        return LocalModel(name, path, config, True, built_models.tokenizer_length(),
                          built_models.TASK_OF[name])  # fmt: skip
    return checked_dir(Path(name).expanduser(), f"--model {name}")


def _as_dir(flag: str) -> Path | None:
    return None if flag in built_models.BUILT else Path(flag).expanduser().absolute()


def checked_dir(path: Path, label: str) -> LocalModel:
    """The user's model directory: what verl's trainer and the rollout read, present and
    matching its config.json (converters.hf_check: headers, tokenizer; nothing loaded)."""
    from backend.shared.errors import CheckpointError
    from converters.hf_check import check_hf_dir

    fix = "pass the directory of a small HF Qwen3-MoE with its tokenizer, or --model tiny"
    if not (path / "config.json").is_file():
        raise LaunchError(f"{label} has no config.json: {fix}")
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise LaunchError(f"{label}: config.json is not JSON ({e}): {fix}") from None
    if config.get("model_type") != "qwen3_moe":
        raise LaunchError(
            f"{label}: config.json's model_type is {config.get('model_type')!r}, not "
            f"'qwen3_moe': the mcore_ep actor trains Qwen3-MoE models; {fix}"
        )
    try:
        check_hf_dir(path, label)
    except CheckpointError as e:
        raise LaunchError(str(e)) from None
    return LocalModel(str(path), path.absolute(), config, False)
