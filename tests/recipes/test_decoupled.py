"""Decoupled PPO in separate_async with mcore_ep (recipes.dapo.engine.decoupled): the weights
verl's trainer saves and restores around a cycle's old-log-prob passes, against verl 0.9.1's
own classes and call order."""

from functools import partial

import pytest
import torch
from verl.workers.utils.losses import ppo_loss

from recipes.dapo.engine.host_snapshots import HostSnapshots
from recipes.dapo.job import trainer_modes
from tests.recipes.test_verl_engine import _on_policy, build_engine, dapo_actor_config, make_batch


def verl_cycle(snapshots, steps: int, train) -> None:
    """verl 0.9.1's `_compute_old_log_prob` over one sync cycle of `steps` mini-batches,
    `train()` between them; the pass itself is checked by the caller's train."""
    for k in range(steps):
        if k == 0:
            snapshots.save(0)
        else:
            snapshots.save(k)
            snapshots.restore(0)
            train("old", k)
            snapshots.restore(k)
            snapshots.clear(k)
        train("update", k)


def test_the_cycle_sees_its_first_weights_and_keeps_one_copy():
    """In verl's call order over two cycles: each later step's old-log-prob pass sees the
    cycle's first weights, the update continues from its own, and one model's copy is held.
    Catches a restore that loses the current weights (training would restart from pi_old)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    snapshots = HostSnapshots(model)
    one_model = sum(p.numel() * p.element_size() for p in model.parameters())
    seen = []

    def state():
        return [p.detach().clone() for p in model.parameters()]

    for _cycle in range(2):
        first = state()
        expected = {}

        def train(what, k, first=first, expected=expected):
            if what == "old":
                seen.append(all(torch.equal(a, b) for a, b in zip(state(), first, strict=True)))
                return
            if k in expected:
                assert all(torch.equal(a, b) for a, b in zip(state(), expected[k], strict=True))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
            expected[k + 1] = state()
            assert snapshots.nbytes() == one_model

        verl_cycle(snapshots, 3, train)
    assert seen == [True, True, True, True]


def test_restoring_what_was_never_saved_is_refused():
    snapshots = HostSnapshots(torch.nn.Linear(2, 2))
    snapshots.save(0)
    snapshots.save(1)
    with pytest.raises(KeyError, match="no saved weights 2"):
        snapshots.restore(2)


@pytest.fixture
def engine(world1, tiny_hf_dir, monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    return build_engine(tiny_hf_dir, param_offload=True, optimizer_offload=True)


def our_worker(engine):
    """Our DetachActorWorker around `engine`, without Ray (the calls verl dispatches to it)."""
    from types import SimpleNamespace

    from recipes.dapo.engine import decoupled

    worker = object.__new__(decoupled.McoreDetachActorWorker)
    worker.actor = SimpleNamespace(engine=engine)
    worker.config = SimpleNamespace(actor=SimpleNamespace(strategy=decoupled.BACKEND))
    return worker


def test_the_engine_recomputes_pi_olds_log_probs_and_trains_on(engine):
    """Through our worker's three calls, in verl's order, with the weights offloaded as verl
    leaves them between passes: restoring the cycle's first weights gives its log-probs bit
    for bit, restoring the step's gives the updated parameters back, and the weights are
    offloaded again after each call. Catches a snapshot read from the freed buffers of an
    offloaded model (it segfaulted the actor rank at step 1 of a separate_async run)."""
    data, worker = make_batch(), our_worker(engine)
    _on_policy(engine, data)
    with engine.eval_mode():
        before = engine.infer_batch(data)["model_output"]["log_probs"].values().clone()
    engine.offload()
    worker.save_model_to_cpu(0)
    assert engine.optim.is_offloaded()
    with engine.train_mode():
        engine.train_batch(data, loss_function=partial(ppo_loss, config=dapo_actor_config()))
    with engine.weights_loaded() as module:
        updated = {n: p.detach().clone() for n, p in module.named_parameters()}
    engine.offload()
    worker.save_model_to_cpu(1)
    worker.restore_model_from_cpu(0)
    assert engine.optim.is_offloaded()
    with engine.eval_mode():
        old = engine.infer_batch(data)["model_output"]["log_probs"].values()
    assert torch.equal(old, before)
    engine.offload()
    worker.restore_model_from_cpu(1)
    worker.clear_cpu_model(1)
    with engine.weights_loaded() as module:
        assert all(torch.equal(updated[n], p) for n, p in module.named_parameters())


def test_verls_worker_and_trainer_extended_not_replaced():
    """Our worker is verl's DetachActorWorker with the three calls re-registered as verl's
    (one to all ranks); our trainer is verl's separate_async trainer under the launcher's name,
    handing its actor roles our worker and leaving the others alone."""
    import ray
    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from recipes.dapo.engine import decoupled

    worker = decoupled.McoreDetachActorWorker
    assert issubclass(worker, DetachActorWorker)
    for name in ("save_model_to_cpu", "restore_model_from_cpu", "clear_cpu_model"):
        assert getattr(getattr(worker, name), MAGIC_ATTR)["dispatch_mode"] == Dispatch.ONE_TO_ALL
    trainer = get_trainer_cls(trainer_modes.DECOUPLED_MODE)
    assert trainer is decoupled.McoreSeparateAsyncTrainer
    assert issubclass(trainer, PPOTrainerSeparateAsync)
    assert (trainer_modes.DECOUPLED_MODE, trainer_modes.DECOUPLED_MODULE) == (
        decoupled.MODE,
        decoupled.__name__,
    )
    other = ray.remote(object)
    mapping = {"actor": ray.remote(DetachActorWorker), "reward": other}
    decoupled.with_our_worker(mapping, DetachActorWorker, worker)
    assert mapping["actor"].__ray_actor_class__ is worker and mapping["reward"] is other


def test_another_verl_is_refused_in_one_line(monkeypatch):
    import verl

    from recipes.dapo.engine import decoupled

    monkeypatch.setattr(verl, "__version__", "0.9.2")
    with pytest.raises(RuntimeError, match=r"this is verl 0\.9\.2: install verl==0\.9\.1"):
        decoupled.check_verl()
    monkeypatch.setattr(verl, "__version__", decoupled.VERL_VERSION)
    decoupled.check_verl()
    monkeypatch.setattr(decoupled, "CALL_ORDER", decoupled.CALL_ORDER[::-1])
    with pytest.raises(RuntimeError, match="no longer calls save/restore/clear"):
        decoupled.check_verl()
