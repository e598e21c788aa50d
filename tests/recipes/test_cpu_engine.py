"""The engine the embedded CPU run trains with (recipes.local.cpu_overrides): our modules on
packed micro-batches, recompute only where memory binds, and each rank's share of the cores,
as the launcher resolves them and verl composes them into the engine's config."""

import pytest

from recipes.dapo.job import overrides
from recipes.launcher import resolution
from recipes.local.cpu_overrides import engine_threads
from tests.support.run_specs import spec_of

ENGINE = "actor_rollout_ref.actor.mcore_ep"


def engine_config(tmp_path, argv):
    """The mcore_ep engine config verl builds from the resolved launch (no launch)."""
    from verl.utils.config import omega_conf_to_dataclass

    from recipes.launcher.verl_schema import compose

    spec = spec_of(["--ckpt-dir", str(tmp_path), *argv, "--dry-run"])
    cli = overrides.to_cli(resolution.resolve_local(spec).groups)
    cfg = compose([item for item in cli if "<" not in item])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.mcore_ep)


@pytest.mark.parametrize(
    "plan, world, recompute",
    [
        ([], 1, "none"),
        (["--tp", "1", "--ep", "2"], 2, "none"),
        (["--tp", "4", "--ep", "8"], 8, "full"),
    ],
)
def test_the_cpu_run_trains_our_modules_packed_with_its_share_of_the_cores(
    plan, world, recompute, tmp_path
):
    """Bugs caught: the CPU run back on megatron-core's reference modules on padded rows
    (BuildOptions' "auto" on CPU: the update 1.8x slower at mini), full recompute where memory
    is plenty (an extra forward per micro-batch), none at world 8 (24 GiB binds there), or
    threads that oversubscribe the cores (8 ranks x 2 threads on 2 cores)."""
    engine = engine_config(tmp_path, ["--model", "mini", *plan])
    assert (engine.experts, engine.attention, engine.packed) == ("grouped", "sdpa", True)
    assert engine.recompute == recompute
    assert engine.cpu_threads == engine_threads(world) >= 1


def test_threads_are_the_ranks_share_of_the_cores():
    assert [engine_threads(w, cores=2) for w in (1, 2, 4, 8)] == [2, 1, 1, 1]
    assert [engine_threads(w, cores=16) for w in (1, 4, 8)] == [16, 4, 2]


def test_verls_fsdp_actor_gets_the_same_recompute_and_none_of_our_keys(tmp_path):
    """The side by side (--engine fsdp) trains under the same recompute choice, and our
    engine's CPU keys do not leak into its config."""
    spec = spec_of(["--ckpt-dir", str(tmp_path), "--engine", "fsdp", "--dry-run"])
    cli = overrides.to_cli(resolution.resolve_local(spec).groups)
    assert not [item for item in cli if ENGINE in item]
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=false" in cli


def test_a_negative_thread_count_is_refused():
    from recipes.dapo.engine.config import EngineConfigError, McoreEpEngineConfig

    with pytest.raises(EngineConfigError, match="cpu_threads=-1: give torch's thread count"):
        McoreEpEngineConfig(cpu_threads=-1)


def test_the_engine_gives_its_rank_the_threads_it_is_told(world1, tiny_hf_dir, monkeypatch):
    """Bug caught: the setting reaching the config but not torch (every rank stays at the job
    env's one thread, half the cores idle in a world-1 update)."""
    import torch

    from tests.recipes.test_verl_engine import build_engine

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        build_engine(tiny_hf_dir, cpu_threads=2, fast=True, packed=True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "trim, at_offload, at_update", [("phase", 1, 0), ("step", 1, 1), ("off", 0, 0)]
)
def test_a_cpu_engine_gives_free_heap_back_where_told(
    world1, tiny_hf_dir, monkeypatch, trim, at_offload, at_update
):
    """Bug caught: the setting not reaching the offload or the update (ours' ranks then keep
    430-470 MiB of freed activations in glibc's heaps at mini, ep 2), or trimming where the
    user turned it off."""
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    from recipes.dapo.engine import verl_engine
    from tests.recipes.test_verl_engine import (
        _on_policy,
        build_engine,
        dapo_actor_config,
        make_batch,
    )

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    calls = []
    monkeypatch.setattr(verl_engine, "trim_host_heap", lambda: calls.append(1) or True)
    engine = build_engine(tiny_hf_dir, fast=True, packed=True, cpu_trim_heap=trim)
    engine.to("cpu")  # verl's offload at a phase's end
    assert len(calls) == at_offload
    data = make_batch()
    _on_policy(engine, data)
    before = len(calls)
    with engine.train_mode(disable_auto_offload=True):  # one update, no offload after it
        engine.train_batch(data, loss_function=partial(ppo_loss, config=dapo_actor_config()))
    assert len(calls) - before == at_update


def test_an_unknown_trim_mode_is_refused():
    from recipes.dapo.engine.config import EngineConfigError, McoreEpEngineConfig

    with pytest.raises(EngineConfigError, match="cpu_trim_heap='always': choose phase, step, off"):
        McoreEpEngineConfig(cpu_trim_heap="always")
