"""Packed (THD) micro-batches (mcore_ep.packed) = the right-padded ones, through verl's engine
interface on the tiny Qwen3-MoE (CPU, fp32, world 1): log-probs, entropy, loss, gradients,
routing counts; and the packing itself (planner, cu_seqlens, masks, positions)."""

from functools import partial

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from backend.shared.integers import round_up
from tests.recipes.test_verl_engine import (
    LENGTHS,
    _engine_grads,
    _on_policy,
    build_engine,
    dapo_actor_config,
    make_batch,
)
from tests.support.aux_gradient import aux_settings


def test_real_token_planner_packs_first_fit_within_the_budget():
    from recipes.dapo.engine.batches import BatchError, plan_by_real_tokens, plan_by_tokens

    lengths = [12, 7, 15, 6, 8, 3]
    plans = plan_by_real_tokens(lengths, budget=20, multiple=4)
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))
    for plan in plans:
        assert round_up(sum(lengths[i] for i in plan), 4) <= 20
    assert len(plans) == 3 < len(plan_by_tokens(lengths, budget=20, multiple=4))
    with pytest.raises(BatchError, match="exceeds max_token_len_per_gpu=8"):
        plan_by_real_tokens(lengths, budget=8, multiple=1)


def dapo_like_lengths(rows: int, seed: int, response_max: int) -> list[int]:
    """Near-fixed prompts (48-80), log-normal responses (median 160), as the bench's mix."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(48, 81, (rows,), generator=gen)
    responses = (160 * (torch.randn(rows, generator=gen) * 0.8).exp()).round()
    return (prompts + responses.clamp(1, response_max).long()).tolist()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("budget", [2048, 4096])
def test_packed_plan_never_holds_more_slots_than_the_padded_plan(seed, tp, budget):
    """One budget rule (micro_batch_slots): a packed micro-batch holds at most the slots of the
    padded plan's largest micro-batch (rows x longest row), so packing cannot raise peak
    activation memory; and it needs no more micro-batches."""
    from recipes.dapo.engine.batches import micro_batch_slots, packed_slot_budget, plan_lengths

    lengths = dapo_like_lengths(64, seed, response_max=budget // 2)
    padded = plan_lengths(lengths, budget, tp, packed=False)
    packed = plan_lengths(lengths, budget, tp, packed=True)
    padded_slots = [micro_batch_slots([lengths[i] for i in p], tp, False) for p in padded]
    packed_slots = [micro_batch_slots([lengths[i] for i in p], tp, True) for p in packed]
    assert packed_slot_budget(lengths, budget, tp) == max(padded_slots) <= budget
    assert max(packed_slots) <= max(padded_slots)
    assert len(packed) <= len(padded)
    for plan in (padded, packed):
        assert sorted(i for p in plan for i in p) == list(range(len(lengths)))
    # balanced: the largest holds less than the cap whenever the count leaves room
    assert max(packed_slots) <= -(-sum(lengths) // len(packed)) + max(lengths) + tp


def test_packed_plan_balances_a_first_fit_remainder():
    from recipes.dapo.engine.batches import plan_by_real_tokens

    lengths = [10, 10, 10, 1, 1]  # first fit at 21: [10, 10, 1], [10, 1] -> [10, 10], [10, 1, 1]
    plans = plan_by_real_tokens(lengths, budget=21, multiple=1)
    assert sorted(sum(lengths[i] for i in p) for p in plans) == [12, 20]


def test_packed_micro_batch_layout_with_a_tp_tail():
    from backend.model.forward import packed_position_ids
    from recipes.dapo.engine.batches import micro_batch, packed_micro_batch

    data = make_batch()
    rows = [0, 2, 3]  # (5, 7), (6, 9), (4, 2): 33 tokens, tp 4 -> 36
    mb = packed_micro_batch(data, rows, tp=4, device="cpu")
    assert mb.ids_BS.shape == (1, 36)
    assert mb.cu_seqlens.tolist() == [0, 12, 27, 33, 36]  # the tail is its own sequence
    assert mb.valid_BS.sum() == 33 and not mb.valid_BS[0, 33:].any()
    assert mb.response_BS[0].nonzero()[:, 0].tolist() == [
        *range(5, 12), *range(18, 27), *range(31, 33)
    ]  # fmt: skip
    assert (~mb.has_next_BS[0]).nonzero()[:, 0].tolist() == [11, 26, 32, 33, 34, 35]
    assert packed_position_ids(mb.cu_seqlens).tolist() == [
        *range(12), *range(15), *range(6), *range(3)
    ]  # fmt: skip
    padded = micro_batch(data, rows, tp=4, device="cpu")
    values_1T = torch.arange(36.0)[None]
    starts = [a[0] for a in mb.to_nested(values_1T).unbind()]
    assert starts == [0, 12, 27]
    ids = mb.to_nested(mb.ids_BS).unbind()
    pairs = zip(ids, padded.ids_BS, mb.lengths_B, strict=True)
    assert all(torch.equal(a, b[:n]) for a, b, n in pairs)
    assert mb.packed.max_seqlen_q == 15 and mb.packed.qkv_format == "thd"


def test_packed_config_needs_sdpa_attention():
    from recipes.dapo.engine.config import EngineConfigError, McoreEpEngineConfig

    assert McoreEpEngineConfig(packed=True).resolved_attention == "sdpa"
    assert McoreEpEngineConfig().resolved_attention == "auto"
    with pytest.raises(EngineConfigError, match="packed=True needs attention"):
        McoreEpEngineConfig(packed=True, attention="local")


def test_sdpa_packed_attention_is_per_sequence_causal():
    """The packed path = causal SDPA on each sequence alone (GQA: 4 heads, 2 groups)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from backend.model.attention import SDPAttention

    gen = torch.Generator().manual_seed(0)
    lengths = [5, 1, 7]
    q_THD, k_TGD, v_TGD = (torch.randn(13, h, 8, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    attn = SDPAttention.__new__(SDPAttention)
    attn.softmax_scale, attn.dropout, attn.training = 8**-0.5, 0.0, False
    out_TE = attn._packed(q_THD, k_TGD, v_TGD, params)
    start = 0
    for n in lengths:
        q, k, v = (t[start : start + n].transpose(0, 1) for t in (q_THD, k_TGD, v_TGD))
        k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
        scores = (q @ k.transpose(1, 2)) * 8**-0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ref = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
        torch.testing.assert_close(out_TE[start : start + n], ref, rtol=1e-5, atol=1e-6)
        start += n


@pytest.fixture
def make_engine(world1, tiny_hf_dir, monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    return partial(build_engine, tiny_hf_dir)


def test_packed_length_ladder_rounds_every_total_up_to_its_step():
    from backend.model.packing import ladder_step
    from recipes.dapo.engine.batches import packed_micro_batch

    assert [ladder_step(d) for d in ("npu", "cuda", "cpu")] == [512, 1, 1]
    assert ladder_step("npu", 0) == ladder_step("npu", 1) == 1 and ladder_step("cpu", 64) == 64
    mb = packed_micro_batch(make_batch(), [0, 2, 3], tp=4, device="cpu", step=16)
    assert mb.ids_BS.shape == (1, 48)  # 33 real tokens -> 48, a multiple of 16 (and of tp)
    assert mb.cu_seqlens.tolist() == [0, 12, 27, 33, 48] and mb.valid_BS.sum() == 33


@pytest.mark.parametrize("step", [64, 512])
def test_the_ladder_bounds_the_packed_shapes_at_little_padding(step):
    """On the DAPO-like mix: every packed total on the ladder, at most step - 1 slots above
    the padded plan's largest micro-batch, no more micro-batches than padded."""
    from recipes.dapo.engine.batches import micro_batch_slots, packed_slot_budget, plan_lengths

    totals = set()
    for seed in range(4):
        lengths = dapo_like_lengths(64, seed, response_max=1024)
        plans = plan_lengths(lengths, 4096, 4, packed=True, step=step)
        slots = [micro_batch_slots([lengths[i] for i in p], step, True) for p in plans]
        assert all(t % step == 0 for t in slots)
        assert max(slots) <= round_up(packed_slot_budget(lengths, 4096, 4), step)
        assert len(plans) <= len(plan_lengths(lengths, 4096, 4, packed=False))
        totals |= set(slots)
    assert len(totals) <= 4096 // step  # a bounded set of shapes


def test_packed_length_step_is_validated():
    from recipes.dapo.engine.config import EngineConfigError, McoreEpEngineConfig

    with pytest.raises(EngineConfigError, match="packed_length_step=-1"):
        McoreEpEngineConfig(packed=True, packed_length_step=-1)


@pytest.fixture(params=[1, 16], ids=["no-ladder", "ladder16"])
def engines(make_engine, request):
    """(padded, packed) engines on the same weights, both with our SDPA attention; packed
    with and without a packed-length ladder of 16 tokens."""
    return make_engine(attention="sdpa"), make_engine(
        attention="sdpa", packed=True, packed_length_step=request.param
    )


@pytest.mark.parametrize("max_tokens", [24, 64, None], ids=["mb24", "mb64", "3-rows"])
def test_packed_log_probs_and_entropy_equal_padded(engines, max_tokens):
    """max_tokens None: fixed micro-batches of 3 rows (use_dynamic_bsz off)."""
    outs = []
    for engine in engines:
        data = make_batch(max_tokens=max_tokens or 64, seeds=(0, 1))
        tu.assign_non_tensor(data, calculate_entropy=True)
        if max_tokens is None:
            tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=3)
        with engine.eval_mode():
            outs.append(engine.infer_batch(data))
    padded, packed = outs
    assert len(packed["loss"]) <= len(padded["loss"])
    for key in ("log_probs", "entropy"):
        a, b = (o["model_output"][key] for o in (padded, packed))
        for row, (x, y) in enumerate(zip(a.unbind(), b.unbind(), strict=True)):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=f"{key} row {row}")


AUX_ON = aux_settings(
    "global_batch"
)  # the coefficients of tests/support/aux_gradient.py's reference


@pytest.mark.parametrize(
    "extra",
    [{}, {"recompute": True}, {"aux_loss": AUX_ON, "recompute": True}, {"ladder": 16}],
    ids=["plain", "recompute", "aux-loss-global-batch", "ladder16"],
)
def test_packed_loss_and_gradients_equal_padded(make_engine, extra, world1, tiny_hf_dir):
    """Also with the router aux loss applied (global_batch: its counting pass runs packed),
    whose router gradient, packed, is the reference's (tests/support/aux_gradient.py), and with packed
    totals on a ladder of 16 tokens (more padding, the same results). Catches a packed path
    that differs from the padded one (loss, gradients, metrics), and with the aux loss an aux
    gradient scaled to 0 (both paths would agree without it)."""
    loss_fn = partial(ppo_loss, config=dapo_actor_config())
    extra = dict(extra)
    ladder = {"packed_length_step": extra.pop("ladder")} if "ladder" in extra else {}
    results = []
    for packed in (False, True):
        engine = make_engine(attention="sdpa", packed=packed, **extra, **(ladder if packed else {}))
        data = make_batch(max_tokens=24, seeds=(0, 1))
        _on_policy(engine, data)
        results.append(_engine_grads(engine, data, loss_fn))
    if "aux_loss" in extra:
        from tests.support.aux_gradient import assert_aux_gradient, reduced_router_grads
        from tests.support.aux_gradient import reference as aux_reference

        on = reduced_router_grads(engine, data, loss_fn)
        plain = {k: v for k, v in extra.items() if k != "aux_loss"}
        off = reduced_router_grads(
            make_engine(attention="sdpa", packed=True, **plain), data, loss_fn
        )
        assert_aux_gradient(on, off, aux_reference(world1, tiny_hf_dir, "global_batch", data))
    (out_pad, grads_pad), (out_pack, grads_pack) = results
    assert sum(out_pack["loss"]) == pytest.approx(sum(out_pad["loss"]), rel=1e-5)
    moe = [k for k in out_pad["metrics"] if k.startswith("moe/")]
    assert "moe/update/tokens" in moe
    assert ("moe/aux_loss/applied" in moe) == ("aux_loss" in extra)
    for key in moe:
        values = out_pad["metrics"][key]
        assert out_pack["metrics"][key] == pytest.approx(values, rel=1e-5, abs=1e-7), key
    assert grads_pack.keys() == grads_pad.keys()
    for name in grads_pad:
        torch.testing.assert_close(
            grads_pack[name], grads_pad[name], rtol=1e-5, atol=1e-7, msg=name
        )


def test_packed_monitor_counts_real_tokens_only(make_engine):
    engine = make_engine(packed=True)
    data = make_batch(max_tokens=32, seeds=(0, 1))
    _on_policy(engine, data)
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=partial(ppo_loss, config=dapo_actor_config()))
    assert out["metrics"]["moe/update/tokens"] == [2 * sum(p + r for p, r in LENGTHS)]


def test_packed_r3_forces_the_rollout_routes_on_every_fed_token(make_engine):
    from tests.backend.test_router_replay import (
        LAYERS,
        Watch,
        forced_mismatches,
        marked_batch,
        rollout_routes,
    )

    engine = make_engine(packed=True, router_replay="R3")
    data = marked_batch(max_tokens=32)
    data["routed_experts"] = rollout_routes(data)
    watch = Watch(engine)
    with engine.eval_mode():
        engine.infer_batch(data)
    checked, wrong, _ = forced_mismatches(watch)
    assert checked == LAYERS * sum(p + r - 1 for p, r in LENGTHS) and wrong == 0


def test_packed_r2_records_the_padded_paths_routes(make_engine):
    from tests.backend.test_router_replay import marked_batch

    recorded = []
    for packed in (False, True):
        engine = make_engine(attention="sdpa", packed=packed, router_replay="R2")
        with engine.eval_mode():
            out = engine.infer_batch(marked_batch(max_tokens=32))
        recorded.append(out["model_output"]["routed_experts"])
    for a, b in zip(*(r.unbind() for r in recorded), strict=True):
        assert torch.equal(a, b)


def packed_vs_padded_rank(rank: int, hf_dir: str, tp: int, ep: int) -> dict:
    """One rank: log-probs, entropy, loss, gradients and routed-token counts, padded then
    packed (sequence parallel under tp: the packed total padded to a multiple of tp)."""
    import os

    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    loss_fn = partial(ppo_loss, config=dapo_actor_config())
    out = {}
    for packed in (False, True):
        engine = build_engine(hf_dir, tp=tp, ep=ep, attention="sdpa", packed=packed)
        data = make_batch(max_tokens=24, seeds=(engine.get_data_parallel_rank(), 7))
        tu.assign_non_tensor(data, calculate_entropy=True)
        with engine.eval_mode():
            infer = engine.infer_batch(data)["model_output"]
        _on_policy(engine, data)
        step, grads = _engine_grads(engine, data, loss_fn)
        out[packed] = {
            "log_probs": [x.clone() for x in infer["log_probs"].unbind()],
            "entropy": [x.clone() for x in infer["entropy"].unbind()],
            "loss": sum(step["loss"]),
            "tokens": step["metrics"].get("moe/update/tokens"),
            "grads": grads,
        }
    return out


def _assert_same(padded: dict, packed: dict) -> None:
    for key in ("log_probs", "entropy"):
        for row, (x, y) in enumerate(zip(padded[key], packed[key], strict=True)):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=f"{key} row {row}")
    assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-5)
    assert packed["tokens"] == padded["tokens"]
    for name, grad in padded["grads"].items():
        torch.testing.assert_close(packed["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_packed_equals_padded_under_tp_and_ep(tiny_hf_dir):
    """2 gloo ranks: sequence-parallel slices of the packed row and EP dispatch, at tp2, ep2
    and tp2 x ep2 in one spawn (megatron-core 0.12.1 cannot run tp=2 with ep=1 and etp=1)."""
    from packaging.version import Version

    from backend.platform.compat import mcore_version
    from tests.support.multiproc import run_plans

    plans = [(2, 1), (1, 2), (2, 2)]
    if mcore_version() < Version("0.13"):
        plans.remove((2, 1))
    for (tp, ep), results in zip(
        plans, run_plans(packed_vs_padded_rank, 2, plans, str(tiny_hf_dir)), strict=True
    ):
        if tp > 1:  # sequence-parallel weights (norms, routers): partial grads, summed over TP
            for packed in (False, True):
                grads = results[0][packed]["grads"]
                summed = {k: sum(r[packed]["grads"][k] for r in results) for k in grads}
                for r in results:
                    r[packed]["grads"] = summed
        for rank, result in enumerate(results):
            try:
                _assert_same(result[False], result[True])
            except AssertionError as err:
                raise AssertionError(f"tp={tp} ep={ep} rank {rank}: {err}") from None


def _bench_module(monkeypatch):
    """scripts/bench/packed_vs_padded.py as a module, its engines on the cpu."""
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    from scripts.bench import packed_vs_padded

    return packed_vs_padded


@pytest.mark.bench
def test_benchmark_prints_packed_over_padded_ratios(world1, monkeypatch, tmp_path, capsys):
    import json

    bench = _bench_module(monkeypatch)
    args = ["--rows", "6", "--iters", "1", "--warmup", "0", "--response-max", "400"]
    result = bench.main([*args, "--max-tokens", "512", "--out", str(tmp_path / "r.json")])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert set(result["ratio"]) == {"update", "old_log_prob"}
    assert all(r > 0 for r in result["ratio"].values())
    assert result["micro_batches"]["packed"] <= result["micro_batches"]["padded"]
    ladder = result["ladder"]  # npu's 512-token ladder on this mix: one packed shape left
    assert ladder["step"] == 512 and ladder["extra_slot_share"] >= 0
    assert ladder["packed_lengths"]["with"] == 1 <= ladder["packed_lengths"]["without"]


@pytest.mark.slow
@pytest.mark.bench
def test_benchmark_memory_runs_each_engine_and_pass_in_a_child(monkeypatch, tmp_path):
    bench = _bench_module(monkeypatch)
    args = ["--rows", "4", "--response-max", "200", "--max-tokens", "512", "--mem-passes", "1"]
    args += ["--jobs", "2"]  # peaks are per child; two at a time on 2 cores
    result = bench.main([*args, "--memory", "--no-timing", "--out", str(tmp_path / "r.json")])
    assert "ratio" not in result  # --no-timing
    for name in ("padded", "packed"):
        assert all(m > 0 for m in result["peak_mib"][name].values())
    assert set(result["memory_ratio"]) == {"update", "old_log_prob"}
    mb = result["per_micro_batch"]
    assert mb["packed_real"]["max"] <= 512 and mb["padded_slots"]["max"] <= 512


def test_packed_log_probs_and_entropy_match_transformers(make_engine, tiny_hf_model):
    from tests.recipes.test_verl_engine import hf_log_probs_and_entropy

    engine, data = make_engine(packed=True), make_batch(max_tokens=24)
    tu.assign_non_tensor(data, calculate_entropy=True)
    with engine.eval_mode():
        out = engine.infer_batch(data)["model_output"]
    with torch.no_grad():
        ref_lp, ref_ent = hf_log_probs_and_entropy(tiny_hf_model, data)
    for ours, ref in ((out["log_probs"], ref_lp), (out["entropy"], ref_ent)):
        for a, b in zip(ours.unbind(), ref.unbind(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
