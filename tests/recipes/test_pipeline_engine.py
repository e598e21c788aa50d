"""The mcore_ep engine at pp=2 (2 gloo processes, one layer per stage) against world size 1,
through megatron-core's 1F1B schedule: the same log-probs, loss, gradient norm, router aux
loss and expert-load metrics, weights after the update, the HF weights streamed for rollout
sync (every stage's tensors on every rank), and an exact resume from a pp=2 checkpoint whose
weights load at pp=1.

Full recompute with the global-batch aux loss: under 1F1B the first stage runs micro-batch
i + 1's forward before micro-batch i's backward replays its layer, so the router tap's
token mask and the aux loss's must be micro-batch i's again at that replay (micro-batches
differ in length: a stale mask does not even fit)."""

import os

import pytest
import torch

from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.slow

AUX = {"mode": "on", "type": "global_batch", "coeff": 1e-2, "z_coeff": 1e-3}
SETTINGS = dict(aux_loss=AUX, recompute="full")


def _step(engine, t, data):
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    with engine.train_mode():
        out = engine.train_batch(
            data, loss_function=partial(ppo_loss, config=t.dapo_actor_config())
        )
    return out


def _with_old_log_probs(engine, data):
    """The old-log-prob pass's log-probs (None on a stage before the last)."""
    with engine.eval_mode():
        return engine.infer_batch(data)["model_output"].get("log_probs")


def _step_metrics(out) -> dict:
    """A step's own metrics: not timings, not the monitor's running totals since start."""
    from verl.utils.metric.utils import Metric

    kept = {k: v for k, v in out["metrics"].items() if "timing" not in k and "cumulative" not in k}
    return {k: v.aggregate() if isinstance(v, Metric) else v for k, v in kept.items()}


def pipeline_rank(rank: int, hf_dir: str, ckpt: str) -> dict:
    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    from verl.workers.utils.padding import response_from_nested

    from backend.qwen3_moe import unfuse_experts
    from converters.hf_io import read_state_dict
    from tests.recipes import test_verl_engine as t

    engine = t.build_engine(hf_dir, pipeline_model_parallel_size=2, **SETTINGS)
    hf = unfuse_experts(read_state_dict(hf_dir))
    streamed = dict(engine.get_per_tensor_param()[0])
    same_weights = streamed.keys() == hf.keys() and all(torch.equal(streamed[k], hf[k]) for k in hf)
    data = t.make_batch()
    log_probs = _with_old_log_probs(engine, data)
    # every rank needs old log-probs in its batch (verl dispatches the same batch to all)
    box = [None if log_probs is None else [x.clone() for x in log_probs.unbind()]]
    torch.distributed.broadcast_object_list(box, src=1)
    nested = torch.nested.as_nested_tensor(box[0], layout=torch.jagged)
    data["old_log_probs"] = response_from_nested(nested, data["response_mask"])
    out = _step(engine, t, data)
    updated = {k: v.clone() for k, v in engine.get_per_tensor_param()[0]}
    engine.save_checkpoint(ckpt, global_step=1)
    after_save = _step(engine, t, data)
    resumed_from = {k: v.clone() for k, v in engine.get_per_tensor_param()[0]}
    engine.load_checkpoint(ckpt)
    after_load = _step(engine, t, data)
    return {
        "stage": engine.groups.rank("pp"),
        "same_weights": same_weights,
        "log_probs": box[0],
        "metrics": out["metrics"],
        "loss": out["loss"],
        "updated": updated,
        "resumed_from_changed": any(not torch.equal(resumed_from[k], updated[k]) for k in updated),
        "after_save": _step_metrics(after_save),
        "after_load": _step_metrics(after_load),
        "is_src": engine.is_mp_src_rank_with_outputs(),
    }


def test_pp2_engine_matches_world1_and_resumes_exactly(world1, tiny_hf_dir, tmp_path, monkeypatch):
    ckpt = tmp_path / "global_step_1" / "actor"
    first, last = run_ranks(pipeline_rank, 2, str(tiny_hf_dir), str(ckpt))
    assert (first["stage"], last["stage"]) == (0, 1)
    assert (first["is_src"], last["is_src"]) == (False, True)
    assert first["same_weights"] and last["same_weights"], "a stage streamed other weights"

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    from verl.workers.utils.padding import response_from_nested

    from recipes.dapo.checkpoints import files
    from recipes.dapo.engine import weights
    from tests.recipes import test_verl_engine as t

    engine = t.build_engine(tiny_hf_dir, **SETTINGS)
    data = t.make_batch()
    ref_lp = _with_old_log_probs(engine, data)
    for a, b in zip(last["log_probs"], ref_lp.unbind(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    data["old_log_probs"] = response_from_nested(ref_lp, data["response_mask"])
    ref = _step(engine, t, data)
    assert sum(last["loss"]) == pytest.approx(sum(ref["loss"]), rel=1e-5)
    mine = last["metrics"]
    assert mine["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    moe = sorted(k for k in ref["metrics"] if k.startswith("moe/"))
    assert any(k.startswith("moe/aux_loss/") for k in moe) and any("load" in k for k in moe)
    for key in moe:  # aux-loss values and the monitor's expert-load figures
        assert mine[key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
    # timing/* are the maximum over ranks: the same on both stages
    timing = {k: v for k, v in first["metrics"].items() if k.startswith("timing/")}
    assert timing and timing == {k: v for k, v in mine.items() if k.startswith("timing/")}

    ref_updated = dict(engine.get_per_tensor_param()[0])
    for r in (first, last):
        assert r["updated"].keys() == ref_updated.keys()
        for k, v in ref_updated.items():
            torch.testing.assert_close(r["updated"][k], v, rtol=1e-5, atol=1e-7, msg=k)

    # resume: the step after load repeats the step after save exactly
    assert last["resumed_from_changed"]
    assert last["after_load"] == last["after_save"]
    # the pp=2 checkpoint's weights load at pp=1 (megatron-core reshards)
    weights.check_sealed([ckpt / files.MODEL_DIR])
    weights.load_model(engine.module, ckpt / files.MODEL_DIR)
    for k, v in engine.get_per_tensor_param()[0]:
        assert torch.equal(v, last["updated"][k]), k
