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
