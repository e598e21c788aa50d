"""The pass-through overrides (after `--`) against verl's config schema, before anything starts.

`check_overrides` composes verl's own Hydra config `ppo_trainer` (verl/trainer/config, found
without importing verl: its package's __init__ pulls in torch) with the run's whole command
line, as verl's `main_ppo` will, and instantiates nothing. An override naming a key verl's
config lacks stops the launch with one line naming the nearest key there is (difflib), instead
of Hydra's traceback after Ray has started. `+key=value` (add) and `~key` (delete) pass as
Hydra reads them. Without pass-through overrides nothing is composed: the launcher's own set
is composed against verl's config by tests/recipes/test_train_script.py.
"""

import difflib
import re
from pathlib import Path

from recipes.dapo.job.overrides import quoted

CONFIG_NAME = "ppo_trainer"
_MISSING = (
    re.compile(r"Could not override '([^']+)'"),
    re.compile(r"Could not delete from config\. '([^']+)' does not exist"),
)
_PRESENT = re.compile(r"Could not append to config\. An item is already at '([^']+)'")


class SchemaError(ValueError):
    """A pass-through override verl's config does not take; the message names the fix."""


def config_dir() -> Path:
    """verl/trainer/config of the installed verl (its package is not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        from backend.platform.optional import MissingDependencyError

        raise MissingDependencyError("verl is not installed: run scripts/bootstrap.sh")
    return Path(spec.submodule_search_locations[0]) / "trainer" / "config"


def compose(cli: list[str]):
    """verl's `ppo_trainer` config with these overrides (Hydra's errors raised as they are)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return hydra_compose(config_name=CONFIG_NAME, overrides=cli)


def check_overrides(cli: list[str], ours: list[str], extra: list[str]) -> None:
    """Raise SchemaError with one line when verl's config refuses `cli`, the run's command
    line: the launcher's own overrides (`ours`) merged with the pass-through ones (`extra`)."""
    if not extra:
        return
    from hydra.errors import HydraException

    try:
        compose([_parsable(item) for item in cli])
    except HydraException as err:
        raise SchemaError(explain(str(err), [_parsable(item) for item in ours], extra)) from None


def explain(message: str, ours: list[str], extra: list[str]) -> str:
    """Hydra's refusal as one line: the override, what verl's config lacks, the nearest key."""
    first = message.strip().splitlines()[0] if message.strip() else "refused"
    for pattern in _MISSING:
        found = pattern.search(message)
        if found:
            key = found[1]
            item = _given(key, extra)
            nearest = nearest_key(key, ours)
            add = (
                f"; a new key is added with +{item.lstrip('~')}" if not item.startswith("~") else ""
            )
            return (
                f"-- {item}: verl's config ({CONFIG_NAME}) has no key {key}: the nearest is "
                f"{nearest}{add}"
            )
    found = _PRESENT.search(message)
    if found:
        item = _given(found[1], extra)
        return (
            f"-- {item}: verl's config ({CONFIG_NAME}) already has {found[1]}: set it without "
            f"the +, as {item.lstrip('+')}"
        )
    return f"verl's config ({CONFIG_NAME}) refuses the overrides after --: {first}"


def _parsable(item: str) -> str:
    """A dry run's placeholder path (`<train-file>`) as a string Hydra can read."""
    key, _, value = item.partition("=")
    return f"{key}={quoted(value)}" if value.startswith("<") else item


def _given(key: str, extra: list[str]) -> str:
    """The pass-through override as the user wrote it that sets or deletes `key`."""
    hits = [item for item in extra if item.split("=", 1)[0].lstrip("+~") == key]
    return hits[-1] if hits else key


def nearest_key(key: str, ours: list[str]) -> str:
    """The key of verl's config (with the launcher's own overrides) closest to `key`."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(compose(ours), resolve=False)
    keys = list(_paths(tree))
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.0)
    return match[0] if match else "(none)"


def _paths(tree, prefix: str = ""):
    for name, value in tree.items() if isinstance(tree, dict) else ():
        path = f"{prefix}{name}"
        yield path
        yield from _paths(value, f"{path}.")
