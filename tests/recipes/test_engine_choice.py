"""`--engine mcore_ep|fsdp`: verl's own FSDP2 actor on the same job (recipes.dapo.job.actors),
registered for the CPU platform through verl's EngineRegistry, its keys alone on the command
line, its refusals, its checkpoint vetted before verl unpickles it (converters.pickles.fsdp_state) and
found by the finish and the resume."""

import subprocess
import sys

import pytest

from parallel.plan import PlanError
from recipes.dapo.job import overrides
from tests.recipes.test_trainer_modes import cli, resolved

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def test_fsdp_on_cpu_sets_only_verls_fsdp_keys(tmp_path):
    """Bugs caught: an mcore_ep.* key on an FSDP run (verl's FSDPActorConfig refuses it), async
    saves (verl then leaves the tracker to an engine that never writes it: no resume), the
    CPU registration or SDPA missing (no engine for device cpu / FlashAttention 2 asked)."""
    kv = cli(resolved(["--engine", "fsdp", "--model", "tiny", "--ckpt-dir", str(tmp_path)]))
    assert not [k for k in kv if overrides.BACKEND in k]
    assert kv["actor_rollout_ref.actor.strategy"] == "fsdp2"
    assert "actor_rollout_ref.actor._target_" not in kv  # verl's FSDPActorConfig
    assert "actor_rollout_ref.actor.checkpoint.async_save" not in kv  # verl's default: false
    assert (
        kv["actor_rollout_ref.actor.checkpoint.save_contents"] == "[model,optimizer,extra,hf_model]"
    )
    assert kv["actor_rollout_ref.model.external_lib"] == "recipes.local.cpu.fsdp_engine"
    assert kv["+actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"
    assert "param_dtype:fp32" in kv["+actor_rollout_ref.actor.fsdp_config.mixed_precision"]
    # only the actor changed: the DAPO loss, batch sizes and rollout are ours' run's
    ours = cli(resolved(["--model", "tiny", "--ckpt-dir", str(tmp_path)]))
    shared = {k for k in ours if not k.startswith(("+actor_rollout_ref.actor.mcore_ep",
              "actor_rollout_ref.actor.", "actor_rollout_ref.model.", "trainer.experiment"))}  # fmt: skip
    assert {k: kv.get(k) for k in shared} == {k: ours[k] for k in shared}
    assert kv["trainer.experiment_name"] == "tiny-qwen3-moe-cpu-fsdp1"


def test_fsdp_on_the_cluster_shards_over_every_device_without_the_cpu_pieces():
    res = resolved(["--device", "npu", "--engine", "fsdp", "--ep", "8"])
    kv = cli(res)
    assert res.run.plan.world == 32 and res.run.plan.tp == 1
    assert "actor_rollout_ref.model.external_lib" not in kv  # verl registers npu itself
    assert not [k for k in kv if "attn_implementation" in k or "mixed_precision" in k]
    assert not [k for k in kv if overrides.BACKEND in k]
    assert "verl's FSDP2 actor (--engine fsdp) on" in res.describe()
    assert "FSDP2 over all 32 ranks" in res.describe()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--tp", "2"],
            "--engine fsdp shards parameters over every rank and splits no layer: drop --tp 2",
        ),
        (["--trainer-mode", "colocate_async"], "--engine fsdp runs --trainer-mode sync"),
    ],
)
def test_fsdp_refuses_what_it_cannot_run(tmp_path, argv, message):
    with pytest.raises(PlanError, match=message):
        resolved(["--engine", "fsdp", "--model", "tiny", "--ckpt-dir", str(tmp_path), *argv])


def test_the_cpu_registration_adds_verls_fsdp_engine_for_cpu_and_changes_no_other():
    """Bug caught: verl's VERL_ENGINE_DEVICE route (every lookup of the job changes), or a
    registration that replaces verl's cuda / npu entries. In a child: the registry is global."""
    code = (
        "import os; os.environ['VERL_PLATFORM'] = 'cpu'\n"
        "import recipes.local.cpu.platform\n"
        "from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead\n"
        "before = dict(EngineRegistry._engines['language_model']['fsdp2'])\n"
        "import recipes.local.cpu.fsdp_engine\n"
        "after = EngineRegistry._engines['language_model']['fsdp2']\n"
        "assert set(after) == set(before) | {'cpu'}, (before, after)\n"
        "assert all(after[k] is before[k] for k in before)\n"
        "assert EngineRegistry.get_engine_cls('language_model', 'fsdp2') is FSDPEngineWithLMHead\n"
        "assert 'VERL_ENGINE_DEVICE' not in os.environ\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
