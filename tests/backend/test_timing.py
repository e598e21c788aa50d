"""StepTimer: nested sections add up, comm share and its warning; MoE dispatch/combine timed
inside megatron-core's dispatcher on the tiny model (world size 1), and removed again."""

import time

import pytest
import torch

from backend.instruments.comm_share import (
    COMM_SHARE_WARN,
    CommLayout,
    add_steps,
    comm_layout,
    comm_share_warning,
)
from backend.instruments.dispatch_timing import MoEDispatchTimer
from backend.instruments.timing import StepTimer

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


def test_comm_share_advice_follows_the_layout(world1):
    """Keeping EP and TP inside a node is advice only for groups that span nodes."""
    metrics = {"timing/step_s": 10.0, "timing/grad_reduce_s": 5.0}

    def advice(layout):
        return comm_share_warning(4, metrics, layout=layout).text

    assert "ep groups span nodes: keep EP and TP inside a node" in advice(
        CommLayout(32, 4, ("ep",))
    )
    for one_node in (CommLayout(2), CommLayout(32, 4)):
        assert "inside a node" not in advice(one_node) and "overlap grad reduction" in (
            advice(one_node)
        )
    assert "one rank, no collective" in advice(CommLayout(1))
    assert comm_layout(world1) == CommLayout(1, 1, (), "cpu")  # gloo: a CPU box


def test_comm_share_on_one_cpu_box_names_gloo_as_the_cause():
    """Catches a 2-rank CPU run told to "fix communication first", as if its gloo share on one
    box said something about a cluster's NCCL/HCCL one."""
    metrics = {"timing/step_s": 10.0, "timing/grad_reduce_s": 3.6}
    text = comm_share_warning(4, metrics, layout=CommLayout(2, device="cpu")).text
    assert "communication takes 36%" in text and "gloo on CPU" in text
    assert "does not predict a cluster's NCCL/HCCL share" in text
    assert "fix communication first" not in text
    # one CPU rank has no collective (its own advice); a cluster's box is not gloo's
    assert "gloo" not in comm_share_warning(4, metrics, layout=CommLayout(1, device="cpu")).text
    assert "fix communication first" in comm_share_warning(4, metrics, layout=CommLayout(2)).text


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
    from backend.model.build import BuildOptions, build_model
    from backend.qwen3_moe import load_qwen3_moe_spec
    from recipes.local.task.hf_checkpoints import tiny_config

    torch.manual_seed(0)
    spec = load_qwen3_moe_spec(tiny_config())
    options = BuildOptions(device="cpu", experts="grouped", attention="sdpa")
    return spec, build_model(spec, groups, options)


def _train_step(model, optimizer, ids, timer):
    from backend.model.forward import forward_logits, token_log_probs

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
    names = timer.last_sections
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


def test_work_between_steps_counts_in_the_next_step():
    clock = ManualClock()
    timer = StepTimer(clock=clock)

    def tensors():
        for _ in range(3):
            clock.now += 0.5  # producing a tensor: timed
            yield "tensor"

    for _ in timer.timed_items("weight_sync", tensors()):
        clock.now += 10.0  # the consumer's time (and idle time): not counted
    with timer.between_steps("onload"):
        clock.now += 1.0
        with timer.between_steps("old_log_prob"):  # inside a window: an ordinary section
            clock.now += 2.0
    clock.now += 100.0  # waiting for the rollout
    timer.step_begin()
    with timer.section("forward_backward"):
        clock.now += 4.0
    metrics = timer.step_end()
    assert metrics == {
        "timing/weight_sync_s": 1.5,
        "timing/onload_s": 1.0,
        "timing/old_log_prob_s": 2.0,
        "timing/forward_backward_s": 4.0,
        "timing/step_s": 8.5,
        "timing/other_s": 0.0,
        "timing/comm_share": 1.5 / 8.5,
    }
    timer.step_begin()
    clock.now += 1.0
    assert timer.step_end()["timing/step_s"] == 1.0  # the windows went with the last step


def test_add_steps_sums_the_seconds_and_recomputes_the_share():
    a = {"timing/step_s": 1.0, "timing/grad_reduce_s": 0.5, "timing/comm_share": 0.5}
    b = {"timing/step_s": 3.0, "timing/optimizer_s": 1.0, "timing/comm_share": 0.0}
    assert add_steps(a, b) == {
        "timing/step_s": 4.0,
        "timing/grad_reduce_s": 0.5,
        "timing/optimizer_s": 1.0,
        "timing/comm_share": 0.125,
    }
    assert add_steps({}, {}) == {"timing/comm_share": 0.0}


def test_many_windows_are_resolved_and_an_abandoned_step_is_dropped(monkeypatch):
    import backend.instruments.timing

    monkeypatch.setattr(backend.instruments.timing, "MAX_WINDOWS", 4)
    clock = ManualClock()
    timer = StepTimer(clock=clock)
    for _ in range(10):
        with timer.between_steps("offload"):
            clock.now += 0.25
    assert len(timer._intervals) < 4  # resolved into seconds every 4 windows
    timer.step_begin()
    with timer.section("optimizer"):
        clock.now += 7.0  # this step fails before step_end
    timer.step_begin()
    with timer.section("optimizer"):
        clock.now += 1.0
    metrics = timer.step_end()
    assert metrics["timing/offload_s"] == 2.5 and metrics["timing/optimizer_s"] == 1.0
    assert metrics["timing/step_s"] == 3.5 and timer.steps == 1


def _max_rank(rank: int) -> dict:
    import torch.distributed as dist

    from backend.instruments.comm_share import max_over_ranks

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        return max_over_ranks(
            {"timing/step_s": 1.0 + rank, "timing/optimizer_s": 3.0 - rank}, "cpu"
        )
    finally:
        dist.destroy_process_group()


def test_max_over_ranks_gives_every_rank_the_slowest_values():
    from tests.support.multiproc import run_ranks

    expected = {"timing/optimizer_s": 3.0, "timing/step_s": 2.0}
    assert run_ranks(_max_rank, 2) == [expected, expected]


def _history(shares: list[float]) -> list[dict]:
    """verl's metric rows as recipes.local.run reads them, with the actor's timing/*."""
    return [
        {
            "step": step,
            "timing_s/step": 2.0,
            "actor/timing/step_s": 1.0,
            "actor/timing/grad_reduce_s": share,
            "actor/timing/forward_backward_s": 1.0 - share,
            "actor/timing/comm_share": share,
        }
        for step, share in enumerate(shares, start=1)
    ]


@pytest.mark.parametrize("shares, warns", [([0.2, 0.3], False), ([0.3, 0.5], True)])
def test_run_summary_warns_when_the_mean_comm_share_is_over_30_percent(
    shares, warns, tmp_path, capsys
):
    from recipes.local.summary import print_summary, write_summary

    summary = write_summary(tmp_path, _history(shares), 0.9, {}, wall_s=9.0, startup_s=1.0)
    print_summary(summary)
    out = capsys.readouterr().out
    mean = sum(shares) / len(shares)
    assert summary["comm_share_mean"] == pytest.approx(mean)
    assert f"communication: {mean:.1%} of the actor's step time" in out
    assert (summary["comm_share_warning"] is not None) == warns
    assert ("WARNING [comm_share] step 2: communication takes 40%" in out) == warns
    assert write_summary(tmp_path, [{"step": 1}], 0.9, {}, 1.0, 0.0).get("comm_share_mean") is None


def test_run_summary_splits_the_step_into_phases_and_names_the_warm_ups_start_up(tmp_path, capsys):
    """Catches a phase averaged over steps that did not run it (a save every 10 steps read as
    a tenth of its cost), validation at step 0 counted as a step's, and a start-up that hides
    the mini model's warm-up, the bootstrap or the first validation inside verl's (a fresh
    clone's `verl 341.7s` held 170 s of bootstrap)."""
    from recipes.local.summary import print_summary, write_summary

    history = [{"step": 0, "timing_s/testing": 50.0}]
    for step in (1, 2):
        history.append({"step": step, "timing_s/step": 10.0, "timing_s/gen": 4.0 + step,
                        "timing_s/update_actor": 3.0, "timing_s/old_log_prob": 1.0,
                        "timing_s/update_weights": 0.5})  # fmt: skip
    history[-1] |= {"timing_s/save_checkpoint": 2.0, "timing_s/testing": 6.0}
    parts = {"bootstrap": 20.0, "prepared": 250.0, "validation_at": 300.0, "warmup": "made"}
    summary = write_summary(tmp_path, history, 0.9, {}, wall_s=400.0, startup_s=330.0,
                            startup_parts_s=parts)  # fmt: skip
    assert summary["step_phases_s"] == {"gen": 5.5, "old-log-prob": 1.0, "update": 3.0,
                                        "weight sync": 0.5, "save": 2.0, "validation": 6.0}  # fmt: skip
    print_summary(summary)
    out = capsys.readouterr().out
    assert ("start-up 330.0s (bootstrap 20.0s, model, data and warm-up 250.0s, verl 30.0s, "
            "the first validation 30.0s)") in out  # fmt: skip
    assert ("a step (mean s): gen 5.5, old-log-prob 1, update 3, weight sync 0.5, save 2, "
            "validation 6\n") in out  # fmt: skip
    print_summary(write_summary(tmp_path, history, 0.9, {}, 400.0, 80.0,
                                startup_parts_s={"prepared": 0.2}))  # fmt: skip
    assert "start-up 80.0s\n" in capsys.readouterr().out  # a reused model: no parts
    reused = {"bootstrap": 0.4, "prepared": 3.0, "validation_at": 60.0, "warmup": "reused"}
    print_summary(write_summary(tmp_path, history, 0.9, {}, 400.0, 80.0, startup_parts_s=reused))
    assert ("start-up 80.0s (model and data 3.0s, the warm-up reused, verl 56.6s, the first "
            "validation 20.0s)") in capsys.readouterr().out  # fmt: skip


def test_run_summary_says_when_the_target_was_reached_or_not(tmp_path, capsys):
    """Catches the line `>= 0.9 first at never` (a run whose validation stays below)."""
    from recipes.local.summary import ACC_KEY, REWARD_KEY, print_summary, write_summary

    def history(final: float) -> list[dict]:
        return [{"step": 0, REWARD_KEY: -0.1, ACC_KEY: 0.4},
                {"step": 5, REWARD_KEY: final, ACC_KEY: 0.8}]  # fmt: skip

    print_summary(write_summary(tmp_path, history(0.586), 0.9, {}, wall_s=300.0, startup_s=80.0))
    assert "(accuracy 0.80); >= 0.9 not reached\n" in capsys.readouterr().out
    print_summary(write_summary(tmp_path, history(0.95), 0.9, {}, wall_s=300.0, startup_s=80.0))
    assert "; >= 0.9 first at step 5 (" in capsys.readouterr().out
