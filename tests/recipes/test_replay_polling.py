"""verl's sync replay buffer as the CPU run builds it (recipes.dapo.engine.replay_polling),
against the one verl's own builder makes, on the run's composed config."""

import time

import pytest

from recipes.dapo.job import overrides
from recipes.launcher import resolution
from tests.support.run_specs import spec_of


def _stand_in_trainer(cfg):
    """What verl's PPOTrainer._build_replay_buffer reads of its trainer, and nothing else."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    class Trainer:
        _build_replay_buffer = PPOTrainer._build_replay_buffer
        _resolve_filter_groups_metric = PPOTrainer._resolve_filter_groups_metric

        def __init__(self):
            self.config, self.trainer_mode = cfg, cfg.trainer.v1.trainer_mode

        def _add_prompts_to_generate(self, count):
            pass

    return Trainer()


def _run_config(tmp_path, *args):
    from recipes.launcher.verl_schema import compose

    spec = spec_of(["--ckpt-dir", str(tmp_path), "--dry-run", *args])
    cli = overrides.to_cli(resolution.resolve_local(spec).groups)
    return compose([c for c in cli if "<" not in c])


def _verls_own(cfg):
    from omegaconf import open_dict

    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.trainer.v1.sampler.custom_sampler.path = None
        cfg.trainer.v1.sampler.sampler_kwargs = {}
    return _stand_in_trainer(cfg)._build_replay_buffer()


def _settings(buffer) -> dict:
    """A buffer's state but for what the two builds are meant to differ in."""
    differ = ("poll_interval", "refill_fn", "sampler_kwargs")
    return {k: v for k, v in vars(buffer).items() if k not in differ}


@pytest.mark.parametrize("model", ["mini", "tiny"])
def test_the_runs_buffer_is_verls_own_but_for_its_poll(model, tmp_path):
    """Bug caught: verl builds a custom sampler without the DAPO arguments of its own sync
    buffer, so one that dropped them would train without DAPO's group filter (or refill
    one batch where verl refills a group at a time) and nothing would say so."""
    from recipes.dapo.engine.replay_polling import PollingReplayBuffer
    from recipes.local.cpu_overrides import POLL_S, TASKS

    cfg = _run_config(tmp_path, "--model", model)
    ours, verls = _stand_in_trainer(cfg)._build_replay_buffer(), _verls_own(cfg)
    assert type(ours) is PollingReplayBuffer and type(verls).__name__ == "ReplayBuffer"
    assert (ours.poll_interval, verls.poll_interval) == (POLL_S, 2.0)
    assert _settings(ours) == _settings(verls)
    assert ours.filter_groups_metric == "acc" and ours.gen_batch_size == 1
    task = TASKS["sums" if model == "mini" else "doubles"]
    assert ours.max_inflight_gen_batches == task["inflight_gen_batches"]


def test_async_modes_keep_verls_buffer(tmp_path):
    """Bug caught: the sync buffer given to colocate_async, whose trainer needs verl's async one."""
    cfg = _run_config(tmp_path, "--trainer-mode", "colocate_async")
    assert cfg.trainer.v1.sampler.custom_sampler.path is None


def test_a_wait_lasts_one_poll_not_verls_two_seconds(tmp_path):
    """Bug caught: the interval not reaching verl's wait (it reads self.poll_interval)."""
    buffer = _stand_in_trainer(_run_config(tmp_path))._build_replay_buffer()
    started = time.perf_counter()
    buffer._wait_for_next_poll("train", time.time())
    assert time.perf_counter() - started < 0.5


def test_a_changed_builder_is_refused_in_one_line(monkeypatch):
    """Bug caught: a verl whose builder computes other DAPO arguments, mirrored silently."""
    from recipes.dapo.engine import replay_polling

    monkeypatch.setattr(replay_polling, "builder_digest", lambda: "0" * 64)
    with pytest.raises(
        RuntimeError, match=r"mirrors verl 0\.9\.1's PPOTrainer\._build_replay_buffer"
    ):
        replay_polling.check_verl()
