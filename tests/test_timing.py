"""StepTimer: nested sections add up, comm share and its warning; MoE dispatch/combine timed
inside megatron-core's dispatcher on the tiny model (world size 1), and removed again."""

import time

import pytest
import torch

from backend.timing import COMM_SHARE_WARN, MoEDispatchTimer, StepTimer, comm_share_warning

pytestmark = pytest.mark.mcore_compat


class ManualClock:
    """Time moves only when the test says so: exact arithmetic."""

    def __init__(self):
        self.now = 0.0

    def mark(self):
        return self.now

    def seconds(self, start, end):
        return end - start

    def wait(self, mark):
        pass


def test_nested_sections_exclude_their_children_and_add_up():
    clock = ManualClock()
    timer = StepTimer(clock=clock)
    timer.step_begin()
    clock.now += 1.0  # uncovered
    with timer.section("forward_backward"):
        clock.now += 2.0
        for _ in range(2):
            with timer.section("moe_dispatch"):
                clock.now += 0.5
            with timer.section("moe_combine"):
                clock.now += 0.25
    with timer.section("grad_reduce"):
        clock.now += 1.5
    with timer.section("optimizer"):
        clock.now += 3.0
    metrics = timer.step_end()
    assert metrics == {
        "timing/forward_backward_s": 2.0,
        "timing/moe_dispatch_s": 1.0,
        "timing/moe_combine_s": 0.5,
        "timing/grad_reduce_s": 1.5,
        "timing/optimizer_s": 3.0,
        "timing/step_s": 9.0,
        "timing/other_s": 1.0,
        "timing/comm_share": 3.0 / 9.0,
    }
    assert comm_share_warning(7, metrics) is not None  # 33% > 30%
    timer.step_begin()
    with timer.section("optimizer"):
        clock.now += 21.0
    timer.step_end()
    run = timer.run_metrics()
    assert run["timing/step_s"] == 30.0 and run["timing/comm_share"] == pytest.approx(0.1)
    assert comm_share_warning(8, run) is None


def test_comm_share_warning_names_the_parts():
    metrics = {"timing/step_s": 10.0, "timing/moe_dispatch_s": 2.0, "timing/grad_reduce_s": 1.5}
    assert comm_share_warning(3, metrics) is not None
    warning = comm_share_warning(3, metrics, threshold=0.3)
    assert warning.kind == "comm_share" and warning.values["comm_share"] == pytest.approx(0.35)
    assert "35% of the step (over 30%)" in warning.line() and "moe_dispatch 2s" in warning.line()
    assert comm_share_warning(3, {**metrics, "timing/grad_reduce_s": 0.9}) is None
    assert COMM_SHARE_WARN == 0.30


def test_misuse_is_refused_and_disabled_timer_is_silent():
    timer = StepTimer()
    timer.step_begin()
    with pytest.raises(ValueError, match="unknown section"):
        timer.start("forward")
    with pytest.raises(RuntimeError, match="not open"):
        timer.stop("optimizer")
    timer.start("optimizer")  # left open by hand: closed and counted at step end
    assert timer.step_end()["timing/unclosed_sections"] == 1
    off = StepTimer(enabled=False)
    off.step_begin()
    with off.section("optimizer"):
        pass
    assert off.step_end() == {}


def _tiny_model(groups):
    from backend.hf_config import load_qwen3_moe_spec
    from backend.model import BuildOptions, build_model
    from recipes.local.tiny_model import tiny_config

    torch.manual_seed(0)
    spec = load_qwen3_moe_spec(tiny_config())
    options = BuildOptions(device="cpu", experts="grouped", attention="sdpa")
    return spec, build_model(spec, groups, options)


def _train_step(model, optimizer, ids, timer):
    from backend.forward import forward_logits, token_log_probs

    with timer.section("forward_backward"):
        logp = token_log_probs(forward_logits(model, ids)[:, :-1], ids[:, 1:])
        (-logp.mean()).backward()
    with timer.section("optimizer"):
        optimizer.step()
        optimizer.zero_grad()


def test_dispatch_and_combine_timed_forward_and_backward_and_parts_add_up(world1):
    spec, model = _tiny_model(world1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    ids = torch.randint(0, spec.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    timer = StepTimer("cpu")
    instrument = MoEDispatchTimer(model, timer)
    assert instrument.num_dispatchers == spec.num_layers
    _train_step(model, optimizer, ids, timer)  # warm-up
    timer.step_begin()
    start = time.perf_counter()
    _train_step(model, optimizer, ids, timer)
    metrics = timer.step_end()
    wall = time.perf_counter() - start
    names = [i.name for i in timer._intervals]
    # forward and backward of each layer's dispatch and combine
    assert names.count("moe_dispatch") == names.count("moe_combine") == 2 * spec.num_layers
    assert metrics["timing/moe_dispatch_s"] > 0 and metrics["timing/moe_combine_s"] > 0
    parts = sum(
        v
        for k, v in metrics.items()
        if k.endswith("_s") and k not in ("timing/step_s", "timing/other_s")
    )
    assert parts == pytest.approx(wall, rel=0.05)
    assert 0 < metrics["timing/comm_share"] < 1
    instrument.remove()
    timer.step_begin()
    _train_step(model, optimizer, ids, timer)
    assert "timing/moe_dispatch_s" not in timer.step_end()
    dispatcher = model.decoder.layers[0].mlp.token_dispatcher
    assert not {"token_dispatch", "token_combine", "token_permutation"} & set(vars(dispatcher))
