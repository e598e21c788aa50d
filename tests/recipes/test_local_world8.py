"""The embedded CPU run beyond world 4 (recipes.local.cpu_overrides): its rollout engines and
its saves, as the launcher resolves them for `--tp 4 --ep 8` on the mini model."""

import pytest

from recipes.dapo.job import overrides
from recipes.launcher import resolution
from tests.support.run_specs import spec_of

pytestmark = pytest.mark.no_mcore

ASYNC = "actor_rollout_ref.actor.checkpoint.async_save"
ROLLOUT_TP = "actor_rollout_ref.rollout.tensor_model_parallel_size"


@pytest.mark.parametrize(
    "plan, rollout_tp, async_save",
    [(["--tp", "4", "--ep", "8"], 4, False), (["--tp", "2", "--ep", "4"], 1, True)],
)
def test_world_8_saves_in_the_step_and_world_4_in_the_background(
    plan, rollout_tp, async_save, tmp_path
):
    """Bug caught: a background save at world 8, whose 8 forked writers grow by copy-on-write
    while the next step generates (+2.3 GB: Ray's memory monitor killed the rollout's workers
    at the step-10 save of a 20-step run, which then hung)."""
    spec = spec_of(["--model", "mini", "--ckpt-dir", str(tmp_path), *plan, "--dry-run"])
    groups = resolution.resolve_local(spec).groups
    assert int(overrides.value_of(groups, ROLLOUT_TP)) == rollout_tp
    assert str(overrides.value_of(groups, ASYNC)).lower() == str(async_save).lower()


@pytest.mark.parametrize(
    "plan, held",
    [(["--tp", "4", "--ep", "8"], True), (["--tp", "2", "--ep", "4"], False), ([], False)],
)
def test_glibcs_mmap_threshold_is_held_beyond_world_4_only(plan, held, tmp_path):
    """Bugs caught: world 8's ranks without it (they grew until Ray's memory line at step 18),
    or every run with it (an fp32 update ~45% slower: the SFT warm-up 321 -> 430 s)."""
    spec = spec_of(["--model", "mini", "--ckpt-dir", str(tmp_path), *plan, "--dry-run"])
    resolved = resolution.resolve_local(spec)
    key = "+ray_kwargs.ray_init.runtime_env.env_vars.MALLOC_MMAP_THRESHOLD_"
    assert ("MALLOC_MMAP_THRESHOLD_" in resolved.run.env) is held
    assert any(item.startswith(key) for item in overrides.to_cli(resolved.groups)) is held
