"""Checkpoint saves in the background (verl's checkpoint.async_save; recipes.dapo.checkpoints.async_save) at
world size 1 on CPU: the save returns before its files are written, the optimizer steps on
meanwhile, and the checkpoint holds the state of the save's moment, bit for bit; it is sealed
(manifests, then verl's tracker) only once complete; a run stopped mid-save resumes from the
newest complete one; the save plan is reused while the structure stays the same."""

import time
from functools import partial

import pytest
import torch

from recipes.dapo.checkpoints import async_save, files, resume
from recipes.dapo.engine import weights
from tests.recipes.test_optim import _adam_state, _train_step
from tests.recipes.test_verl_engine import build_engine

pytestmark = pytest.mark.mcore_compat  # megatron-core's async path differs between releases
WRITE_DELAY_S = 3.0  # the forked writer waits this long before writing


@pytest.fixture
def make_engine(world1, tiny_hf_dir, monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    return partial(build_engine, tiny_hf_dir)


@pytest.fixture
def slow_writer(monkeypatch):
    """Every torch_dist write starts WRITE_DELAY_S late (the forked writer inherits it)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    # the writer's entry point: _multiproc up to megatron-core 0.16, _multithread in 0.19
    name = next(n for n in ("write_preloaded_data_multiproc", "write_preloaded_data_multithread")
                if hasattr(FileSystemWriterAsync, n))  # fmt: skip
    write = getattr(FileSystemWriterAsync, name)

    def late(*args, **kwargs):
        time.sleep(WRITE_DELAY_S)
        return write(*args, **kwargs)

    monkeypatch.setattr(FileSystemWriterAsync, name, staticmethod(late))


def _async(**checkpoint):
    from verl.trainer.config import CheckpointConfig

    return CheckpointConfig(async_save=True, **checkpoint)


def _state(engine) -> tuple[dict, list[dict]]:
    """Parameters and Adam state as they are now (offloaded parameters loaded to be read)."""
    offloaded = engine.optim.is_offloaded()
    if offloaded:
        engine.onload(model=True, optimizer=False, grad=False)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if offloaded:
        engine.offload(model=True, optimizer=False)
    return params, _adam_state(engine)


def _spy(calls: list, owner, *names) -> None:
    """Append the names of these methods of owner to calls, as they are called from now on."""
    for name in names:
        real = getattr(owner, name)
        setattr(
            owner, name, partial(lambda n, f, *a, **k: calls.append(n) or f(*a, **k), name, real)
        )


def _assert_state(engine, state) -> None:
    params, adam = state
    for name, p in engine.module.named_parameters():
        assert torch.equal(p, params[name]), name
    for a, b in zip(_adam_state(engine), adam, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_step_goes_on_and_the_checkpoint_holds_the_saves_moment(
    make_engine, slow_writer, tmp_path
):
    """Parameters and optimizer state offloaded, as in the shipped plans: the save returns
    before its write starts, offloads the parameters (freeing what the plan found them in)
    and the next step changes the host-resident Adam moments in place; the checkpoint still
    holds both as they were at the save."""
    engine = make_engine(checkpoint_config=_async(), param_offload=True, optimizer_offload=True)
    _train_step(engine, seed=0)
    at_save = _state(engine)
    root = tmp_path / "global_step_1" / "actor"
    calls = []
    _spy(calls, engine.writer, "commit", "write")
    _spy(calls, engine, "offload")
    start = time.perf_counter()
    engine.save_checkpoint(str(root), global_step=1)
    assert time.perf_counter() - start < WRITE_DELAY_S  # returned before the write began
    # offloaded once the writer has its copy: on a device the plan's write items are views
    # of the shards, copied to the host only when the writer starts (on CPU megatron-core
    # clones views at planning, so the order cannot show in the bytes here)
    assert calls[-2:] == ["commit", "offload"] and "offload" not in calls[:-1]
    model, optim = root / files.MODEL_DIR, root / files.OPTIM_STATE
    assert not (model / ".metadata").exists() and not files.is_complete(root)
    assert not (tmp_path / files.TRACKER).exists()
    assert engine.optim.is_offloaded()  # the parameters' storage given back meanwhile
    _train_step(engine, seed=1)  # the optimizer state (on the host) changes in place meanwhile
    assert engine.writer.pending is not None  # still writing: the step did not wait for it
    at = at_save[1], _state(engine)[1]
    moved = [not torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(*at, strict=True)]
    assert any(moved)
    engine.writer.finish()
    assert files.is_complete(root) and (tmp_path / files.TRACKER).read_text() == "1"
    for d in (model, optim):  # every byte in its manifest, checked as a resume checks it
        weights.check_sealed([d])

    resumed = make_engine()
    resumed.load_checkpoint(str(root))
    _assert_state(resumed, at_save)


def test_a_train_batch_seals_a_finished_save_and_the_next_save_waits_for_one(make_engine, tmp_path):
    engine = make_engine(checkpoint_config=_async(), optimizer_offload=True)
    first = tmp_path / "global_step_1" / "actor"
    engine.save_checkpoint(str(first), global_step=1)
    while engine.writer.pending is not None:  # each train_batch moves it on, never waits
        _train_step(engine, seed=0)
    assert files.is_complete(first) and (tmp_path / files.TRACKER).read_text() == "1"
    second = tmp_path / "global_step_2" / "actor"
    engine.save_checkpoint(str(second), global_step=2)
    third = tmp_path / "global_step_3" / "actor"
    engine.save_checkpoint(str(third), global_step=3, max_ckpt_to_keep=2)
    assert files.is_complete(second)  # sealed before the third one started
    engine.writer.finish()
    assert (tmp_path / files.TRACKER).read_text() == "3"
    assert not first.exists() and files.is_complete(third)  # max_ckpt_to_keep of the sealed


def test_the_runs_last_save_returns_sealed(make_engine, tmp_path):
    """verl saves at its last step, and nothing polls the writer after it. The last step is
    verl's total_training_steps in trainer steps: here step 2 of 2 after one update, as in a
    resumed run whose step had no actor update (trainer.critic_warmup). Catches the update
    count taken as the clock (1 < 2: the run's last save left unsealed, the tracker at 1)."""
    from verl.workers.config import FSDPOptimizerConfig

    optim = FSDPOptimizerConfig(lr=1e-3, lr_warmup_steps=4, clip_grad=1.0, total_training_steps=2)
    engine = make_engine(checkpoint_config=_async(), optimizer_config=optim)
    _train_step(engine, seed=0)  # step 1's update; step 2 updates nothing
    root = tmp_path / "global_step_2" / "actor"
    engine.save_checkpoint(str(root), global_step=2)
    assert engine.writer.pending is None and files.is_complete(root)
    assert (tmp_path / files.TRACKER).read_text() == "2"


def test_a_run_stopped_while_saving_resumes_from_the_newest_complete_one(
    make_engine, slow_writer, tmp_path, capsys
):
    """The files as a run killed mid-save leaves them: step 2 half written, the tracker at 1."""
    engine = make_engine(checkpoint_config=_async())
    engine.save_checkpoint(str(tmp_path / "global_step_1" / "actor"), global_step=1)
    engine.writer.finish()
    engine.save_checkpoint(str(tmp_path / "global_step_2" / "actor"), global_step=2)
    try:
        groups = {"trainer": {"trainer.default_local_dir": str(tmp_path)}}
        assert resume.resume_dir(groups, tmp_path) == tmp_path / "global_step_1"
        assert resume.settle_unfinished(groups, tmp_path) == (
            f"resuming from {tmp_path / 'global_step_1'}, the newest complete checkpoint: "
            f"{tmp_path / 'global_step_2'} was not completely written (the run stopped while "
            "saving it; the next save of that step replaces it)"
        )
        with pytest.raises(weights.CheckpointError, match="not completely written") as err:
            make_engine().load_checkpoint(str(tmp_path / "global_step_2" / "actor"))
        assert "\n" not in str(err.value)
    finally:
        engine.writer.finish()


def _sharded(shape: tuple[int, ...]) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(shape))}


def test_the_save_plan_is_reused_while_the_structure_is_unchanged(world1, tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing import load, state_dict_utils
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    checks = []
    for module in (fully_parallel, state_dict_utils):  # the DP wrapper's check, save()'s check
        real = module.validate_sharding_integrity
        count = partial(lambda real, *a, **k: checks.append(1) or real(*a, **k), real)
        monkeypatch.setattr(module, "validate_sharding_integrity", count)
    writer = async_save.CheckpointWriter(world1.dp, torch.device("cpu"))
    strategies = []
    for i, shape in enumerate([(4, 3), (4, 3), (4, 3), (5, 3)]):
        out = tmp_path / f"save{i}"
        writer.write("model", _sharded(shape), out, async_save=True)
        writer.commit(async_save.PendingSave(out, [out], None, i))
        writer.finish()
        strategies.append(writer.plans._strategies["model"])
        assert load(_sharded(shape), str(out))["w"].shape == shape
    assert strategies[0] is strategies[1] is strategies[2] is not strategies[3]
    assert len(checks) == 2  # the sharding checked once per structure
    base = strategies[2]  # torch DCP's plan: cached and validated by the 3rd save
    assert base.validated_cache_reuse and base.cached_global_metadata is not None


def _saved(root, step: int, complete: bool) -> None:
    """An actor checkpoint's directories; complete ones carry their manifests."""
    for sub in (files.MODEL_DIR, files.OPTIM_STATE):
        d = root / f"global_step_{step}" / "actor" / sub
        d.mkdir(parents=True)
        if complete:
            (d / "manifest.json").write_text("{}")


def test_the_tracker_never_names_a_half_written_checkpoint_to_verl(tmp_path):
    """A tracker naming a half-written step (a copy cut short, an older engine's save) is
    pointed at the newest complete one below it, or removed when there is none; a resume
    path naming one is refused in one line."""
    groups = {"trainer": {"trainer.default_local_dir": str(tmp_path)}}
    _saved(tmp_path, 2, complete=True)
    _saved(tmp_path, 4, complete=True)
    _saved(tmp_path, 6, complete=False)
    assert resume.settle_unfinished(groups, tmp_path).startswith("starting afresh (no checkpoint")
    (tmp_path / files.TRACKER).write_text("6")
    assert resume.settle_unfinished(groups, tmp_path) == (
        f"resuming from {tmp_path / 'global_step_4'}, the newest complete checkpoint: "
        f"{tmp_path / 'global_step_6'} was not completely written (the run stopped while "
        "saving it; the next save of that step replaces it)"
    )
    assert (tmp_path / files.TRACKER).read_text() == "4"
    assert resume.resume_dir(groups, tmp_path) == tmp_path / "global_step_4"
    assert resume.settle_unfinished(groups, tmp_path).startswith(
        f"resuming from {tmp_path / 'global_step_4'}"
    )  # said again at every launch while step 6 stays half written
    path = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": "global_step_6"}
    with pytest.raises(weights.CheckpointError, match="not completely written") as err:
        resume.settle_unfinished({"trainer": path}, tmp_path)
    model_dir = files.MODEL_DIR
    assert str(err.value).startswith(f"{tmp_path / 'global_step_6' / 'actor' / model_dir}")
    for step in (2, 4):
        (tmp_path / f"global_step_{step}" / "actor" / model_dir / "manifest.json").unlink()
    (tmp_path / files.TRACKER).write_text("4")
    assert resume.settle_unfinished(groups, tmp_path).startswith("starting afresh (no complete")
    assert not (tmp_path / files.TRACKER).exists()  # verl starts afresh
    assert resume.resume_dir(groups, tmp_path) is None
