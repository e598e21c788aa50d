"""The engine's optimizer (megatron-core DDP + distributed Adam, fp32 on CPU) at world size 1:
one step against torch's AdamW, no decay on 1-D params, exact resume, offload after a load,
old pickled optimizer files refused."""

from functools import partial

import pytest
import torch
from verl.workers.utils.losses import ppo_loss

from recipes.dapo.engine import weights
from tests.recipes.test_verl_engine import _on_policy, build_engine, dapo_actor_config, make_batch

pytestmark = pytest.mark.mcore_compat  # the 0.12.1 shims and checkpoint format too

LR, WARMUP, DECAY, CLIP, BETAS, EPS = 1e-3, 4, 0.1, 1.0, (0.9, 0.999), 1e-8  # build_engine's


@pytest.fixture
def make_engine(world1, tiny_hf_dir, monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    return partial(build_engine, tiny_hf_dir)


def _loss():
    return partial(ppo_loss, config=dapo_actor_config())


def _train_step(engine, seed):
    data = make_batch(seeds=(seed,))
    _on_policy(engine, data)
    with engine.train_mode():
        engine.train_batch(data, loss_function=_loss())
        engine.lr_scheduler_step()


def _adam_state(engine) -> list[dict]:
    return [
        {k: v.clone() for k, v in opt.optimizer.state[p].items()}
        for opt in engine.optim.chained()
        for group in opt.optimizer.param_groups
        for p in group["params"]
    ]


def test_step_equals_torch_adamw_without_decay_on_1d(make_engine):
    engine, data = make_engine(), make_batch()
    _on_policy(engine, data)
    named = dict(engine.module.named_parameters())
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(data, _loss())
        before = {n: p.detach().clone() for n, p in named.items()}
        grads = {n: p.main_grad.detach().clone() for n, p in named.items()}
        norm = engine.optimizer_step()

    total = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
    assert norm == pytest.approx(total, rel=1e-6)
    ref = {n: torch.nn.Parameter(p.clone()) for n, p in before.items()}
    coeff = CLIP / (total + 1e-6)
    for n, p in ref.items():
        p.grad = grads[n] * coeff if coeff < 1 else grads[n]
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in ref.values() if p.ndim > 1], "weight_decay": DECAY},
            {"params": [p for p in ref.values() if p.ndim <= 1], "weight_decay": 0.0},
        ],
        lr=LR / WARMUP,  # update 0 of the warm-up
        betas=BETAS,
        eps=EPS,
    )
    adamw.step()
    for n, p in named.items():
        torch.testing.assert_close(p.detach(), ref[n].detach(), rtol=1e-6, atol=1e-8, msg=n)


def test_param_groups_decay_only_matrices(make_engine):
    engine = make_engine()
    seen = 0
    for opt in engine.optim.chained():
        for param, (group, _) in opt.model_param_group_index_map.items():
            decay = opt.optimizer.param_groups[group]["weight_decay"]
            assert decay == (DECAY if param.ndim > 1 else 0.0), tuple(param.shape)
            seen += 1
    assert seen == sum(1 for _ in engine.module.parameters())


def test_resume_equals_uninterrupted_run_bit_for_bit(make_engine, tmp_path):
    run = make_engine()
    _train_step(run, seed=0)
    root = tmp_path / "actor"
    run.save_checkpoint(str(root), global_step=1)
    _train_step(run, seed=1)

    resumed = make_engine()
    resumed.load_checkpoint(str(root))
    assert resumed.optim.updates == 1 and resumed.optim.lr == pytest.approx(LR * 2 / WARMUP)
    _train_step(resumed, seed=1)
    assert resumed.optim.lr == run.optim.lr
    for (name, a), b in zip(
        run.module.named_parameters(), resumed.module.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    for a, b in zip(_adam_state(run), _adam_state(resumed), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_offloads_again_when_offload_is_on(make_engine, tmp_path, monkeypatch):
    from verl.utils import megatron_utils

    engine = make_engine()
    _train_step(engine, seed=0)
    root = tmp_path / "actor"
    engine.save_checkpoint(str(root), global_step=1)

    offloaded = make_engine(param_offload=True, optimizer_offload=True)
    assert offloaded.optim.is_offloaded()  # initialize offloads (verl's functions, cpu to cpu)
    calls = []
    real = megatron_utils.offload_megatron_optimizer
    monkeypatch.setattr(
        megatron_utils, "offload_megatron_optimizer", lambda o: calls.append(o) or real(o)
    )
    offloaded.load_checkpoint(str(root))
    assert offloaded.optim.is_offloaded()  # parameter buffers freed again, contents on the host
    assert calls == [offloaded.optim.optimizer]  # and the optimizer state offloaded after load
    _train_step(offloaded, seed=1)  # the train context loads everything back
    _train_step(engine, seed=1)
    trained = dict(engine.get_per_tensor_param()[0])
    for name, tensor in offloaded.get_per_tensor_param()[0]:
        assert torch.equal(tensor, trained[name]), name


def test_old_pickled_optimizer_files_are_refused_in_one_line(make_engine, tmp_path):
    engine = make_engine()
    root = tmp_path / "actor"
    engine.save_checkpoint(str(root), global_step=1)
    (root / "optim" / "rank_00000.pt").write_bytes(b"pickle")
    with pytest.raises(weights.CheckpointError, match="pickled") as err:
        engine.load_checkpoint(str(root))
    assert "\n" not in str(err.value)
