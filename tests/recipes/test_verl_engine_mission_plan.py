"""The mcore_ep engine at the mission's plan, tp4 x ep8 on 8 gloo ranks (dp 2, edp 1), through
verl's engine interface, against world size 1 on the same batch in fp32.

The model has the mission's routing and heads (128 experts, top-8, 32 query / 4 KV heads; 2
layers, head_dim 16). One spawn of 8 ranks does, per rank:
- the old-log-prob pass (`infer_batch`) and the HF weight stream for rollout sync;
- one DAPO update (`train_batch`): loss, grad norm, and the weights after it;
- a checkpoint saved by the 8 ranks, with the routing report beside it;
- with R3, the old-log-prob pass and a forward-backward on given routes (not the router's).

The parent compares with world size 1: log-probs within 1e-5, grad norm and loss, every updated
weight, the export of the tp4 x ep8 checkpoint reloaded in transformers, R3's log-probs and
its update route match (1.0), and the report's EP table at the run's ep 8 against the counts.
"""

import os

import pytest
import torch

from tests.backend.test_actor import MISSION_SHAPE
from tests.recipes.test_comm_bytes import assert_model_matches, comm_env
from tests.recipes.test_verl_engine_multiproc import (
    REPLICA_LENGTHS,
    UPDATE_RTOL,
    _batch,
    _loss,
    _update_error,
)
from tests.support.multiproc import run_ranks

pytestmark = pytest.mark.slow

WORLD, TP, EP = 8, 4, 8
SHAPE = {**MISSION_SHAPE, "vocab_size": 128}  # make_batch's token ids run to 127
LOGPROB_TOLERANCE = 1e-5
LOSS = "actor/pg_loss"


def with_routes(data, replicas, layers: int, experts: int, top_k: int):
    """The batch with R3 routes: per row, random distinct experts per (token, layer), drawn by
    (replica, row), so world 1's rows carry the replicas' routes. Not the router's choice: a
    plan that replays the wrong token's routes changes the log-probs."""
    routes = []
    for replica in replicas:
        for row, (p_len, r_len) in enumerate(REPLICA_LENGTHS[replica]):
            gen = torch.Generator().manual_seed(1000 * replica + row)
            rows = [
                torch.randperm(experts, generator=gen)[:top_k]
                for _ in range((p_len + r_len) * layers)
            ]
            routes.append(torch.stack(rows).reshape(p_len + r_len, layers, top_k).to(torch.int16))
    data["routed_experts"] = torch.nested.as_nested_tensor(routes, layout=torch.jagged)
    return data


def sum_loss(model_output, data, dp_group=None):
    return model_output["log_probs"].values().sum(), {}


def run_engine(hf_dir, ckpt_dir, tp: int = 1, ep: int = 1) -> dict:
    """What one rank (or world size 1, on both replicas' rows) reports, as the docstring says."""
    from verl.workers.utils.padding import response_from_nested

    from backend.qwen3_moe import unfuse_experts
    from converters.hf_io import read_state_dict
    from tests.recipes.test_verl_engine import build_engine

    engine = build_engine(hf_dir, tp=tp, ep=ep)
    dp_rank, dp = engine.get_data_parallel_rank(), engine.get_data_parallel_size()
    replicas = (dp_rank,) if dp > 1 else (0, 1)
    data = _batch(2, dp_rank) if dp > 1 else _batch(2)
    with engine.eval_mode():
        old = engine.infer_batch(data)["model_output"]["log_probs"]
    data["old_log_probs"] = response_from_nested(old, data["response_mask"])
    hf = unfuse_experts(read_state_dict(hf_dir))
    streamed = dict(engine.get_per_tensor_param()[0])  # replicated ones: the live parameters
    same_stream = streamed.keys() == hf.keys() and all(torch.equal(streamed[k], hf[k]) for k in hf)
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=_loss())
    with engine.eval_mode():
        after = engine.infer_batch(data)["model_output"]["log_probs"]
    engine.save_checkpoint(str(ckpt_dir), global_step=1)
    result = {
        "dp_rank": dp_rank,
        "old": [x.clone() for x in old.unbind()],
        "after": [x.clone() for x in after.unbind()],
        "same_stream": same_stream,
        "metrics": {k: v for k, v in out["metrics"].items() if not k.startswith("timing/")},
        "updated": {k: v.clone() for k, v in engine.get_per_tensor_param()[0]},
    }
    spec = engine.spec
    r3 = build_engine(hf_dir, tp=tp, ep=ep, router_replay="R3")
    routed = with_routes(_batch(2, dp_rank) if dp > 1 else _batch(2), replicas,
                         spec.num_layers, spec.num_experts, spec.top_k)  # fmt: skip
    with r3.eval_mode():
        log_probs = r3.infer_batch(routed)["model_output"]["log_probs"]
    result["r3"] = [x.clone() for x in log_probs.unbind()]
    with r3.train_mode():
        r3.optimizer_zero_grad()
        metrics = r3.forward_backward_batch(routed, sum_loss)["metrics"]
    result["r3_match"] = metrics["moe/update_route_match/min"]
    return result


def mission_rank(rank: int, hf_dir: str, ckpt_dir: str) -> dict:
    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    return run_engine(hf_dir, ckpt_dir, TP, EP)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.support.model_dirs import built

    return built(tmp_path_factory.mktemp("mission") / "model", SHAPE)


@pytest.fixture(scope="module")
def world8(model_dir, tmp_path_factory):
    """The 8 ranks' results and checkpoint, with the bytes each moved (comm_bytes) beside."""
    ckpt = tmp_path_factory.mktemp("world8") / "ckpt"
    with pytest.MonkeyPatch.context() as env:
        comm_env(env, ckpt.parent / "comm")
        return run_ranks(mission_rank, WORLD, str(model_dir), str(ckpt), timeout=900), ckpt


@pytest.fixture(scope="module")
def world1_ref(world1, model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VERL_ENGINE_DEVICE", "cpu")
        ckpt = tmp_path_factory.mktemp("world1") / "ckpt"
        return run_engine(model_dir, ckpt), ckpt


def _rows(ref_rows, dp_rank: int, dp: int = 2):
    per = len(ref_rows) // dp
    return ref_rows[dp_rank * per : (dp_rank + 1) * per]


def _assert_rows_close(ours, ref, what: str):
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        gap = float((a - b).abs().max())
        assert gap < LOGPROB_TOLERANCE, f"{what}, row {i}: off world size 1's by {gap:.2e}"


def test_the_old_log_probs_and_the_weight_stream_at_tp4_ep8_are_world1s(world8, world1_ref):
    """Catches a log-prob gathered over the wrong TP ranks or rows given to the wrong DP
    replica, and a weight stream that gathers TP shards or EP experts out of order."""
    results, _ = world8
    ref, _ = world1_ref
    assert sorted(r["dp_rank"] for r in results) == [0] * 4 + [1] * 4  # dp 2
    for r in results:
        assert r["same_stream"], "the streamed HF weights differ from the checkpoint's"
        _assert_rows_close(r["old"], _rows(ref["old"], r["dp_rank"]), "old log-prob")


def test_the_first_update_at_tp4_ep8_is_world1s(world8, world1_ref, model_dir):
    """Loss and grad norm as world 1's, every weight after the update (mutation: experts
    permuted across EP ranks on load, the update goes to other experts), and the next
    log-probs."""
    results, _ = world8
    ref, _ = world1_ref
    initial = _initial(model_dir)
    norms = [r["metrics"]["grad_norm"] for r in results if r["metrics"].get("grad_norm")]
    assert norms and all(n == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5) for n in norms)
    # the DAPO loss: verl's Metric sums a rank's micro-batches and averages over DP replicas
    # (world 1 has 5 micro-batches, a replica here 3: compared as totals)
    per_replica = {}
    for r in results:
        per_replica.setdefault(r["dp_rank"], set()).add(r["metrics"][LOSS].aggregate())
    assert all(len(v) == 1 for v in per_replica.values()), "TP ranks of a replica disagree"
    mean = sum(v.pop() for v in per_replica.values()) / len(per_replica)
    assert mean == pytest.approx(ref["metrics"][LOSS].aggregate(), rel=1e-5)
    for r in results:
        first = r["updated"]
        assert first.keys() == ref["updated"].keys()
        errors = {k: _update_error(first[k], v, initial[k]) for k, v in ref["updated"].items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] < UPDATE_RTOL, f"{worst}: off world size 1's by {errors[worst]:.2e}"
        _assert_rows_close(r["after"], _rows(ref["after"], r["dp_rank"]), "log-prob after")


def _initial(model_dir):
    from backend.qwen3_moe import unfuse_experts
    from converters.hf_io import read_state_dict

    return unfuse_experts(read_state_dict(model_dir))


def _transformers_log_probs(hf_dir, data) -> list[torch.Tensor]:
    """Per row, log p(token t+1 | tokens <= t) from transformers in fp32 (the engine's layout
    without its last, unfed position)."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in data["input_ids"].unbind():
            log_p = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
            rows.append(log_p[:-1].gather(-1, ids[1:, None])[:, 0].float())
    return rows


def test_the_tp4_ep8_checkpoint_exports_what_transformers_serves(world8, model_dir, tmp_path):
    """The 8 ranks' checkpoint, exported to HF: bit-equal to the weights the engine streams
    after the update, and transformers' log-probs on it equal the engine's (mutation: TP shards
    concatenated in the wrong order on export)."""
    from backend.qwen3_moe import unfuse_experts
    from converters.cli import main as converters
    from converters.hf_io import read_state_dict

    results, ckpt = world8
    argv = ["mcore-to-hf", str(ckpt), str(tmp_path / "hf"), "--template", str(model_dir),
            "--no-progress"]  # fmt: skip
    assert converters(argv) == 0
    exported = unfuse_experts(read_state_dict(tmp_path / "hf"))
    streamed = results[0]["updated"]
    assert exported.keys() == streamed.keys()
    assert [k for k in streamed if not torch.equal(exported[k], streamed[k])] == []
    theirs = _transformers_log_probs(tmp_path / "hf", _batch(2))
    for r in results:
        ours = [row[:-1] for row in r["after"]]
        _assert_rows_close(ours, _rows(theirs, r["dp_rank"]), "transformers on the export")


def test_r3_at_ep8_replays_the_given_routes(world8, world1_ref):
    """The rollout's routes, sliced for 8 EP ranks, 4 TP (sequence-parallel) slices and 2
    replicas: log-probs as world 1's under the same routes, and the update's route match 1.0.
    The routes are not the router's own, so replaying another token's changes the log-probs."""
    results, _ = world8
    ref, _ = world1_ref
    moved = max(float((a - b).abs().max()) for a, b in zip(ref["r3"], ref["old"], strict=True))
    assert moved > 1e-2, "R3's routes did not change world 1's log-probs"
    for r in results:
        _assert_rows_close(r["r3"], _rows(ref["r3"], r["dp_rank"]), "R3 log-prob")
        assert r["r3_match"] == [1.0] or r["r3_match"] == 1.0
    assert ref["r3_match"] in ([1.0], 1.0)


def test_the_routing_reports_ep_table_at_ep8_sums_to_the_runs_counts(world8, world1_ref):
    """The report the 8 ranks saved: plan ep 8, the update's counts equal world 1's (the world's
    tokens, each counted once), and its EP table at ep 8 gives rank r the counts of experts
    [16 r, 16 r + 16), summing to the counts."""
    from backend.monitor.render_experts import ep_rows
    from backend.monitor.report import load_report

    report = load_report(world8[1] / "moe_report.json")
    ref = load_report(world1_ref[1] / "moe_report.json")
    assert report.ep == EP and report.meta["plan"]["tp"] == TP
    counts_LE = report.cumulative("update")
    assert torch.equal(counts_LE, ref.cumulative("update"))
    rows = {row["ep"]: row for row in ep_rows(counts_LE, report.ep)}
    load_LR = torch.as_tensor(rows[EP]["load_LR"])
    assert torch.equal(load_LR.sum(-1), counts_LE.sum(-1))
    assert torch.equal(load_LR, counts_LE.reshape(counts_LE.shape[0], EP, -1).sum(-1))


def test_tp4_ep8_moves_what_the_traffic_model_says(world8, model_dir):
    """Each rank's bytes by group (TP / EP / DP) in the old-log-prob pass, the weight stream
    and the update, counted in the collectives, against parallel.step_traffic at tp4 x ep8."""
    assert_model_matches(world8[1].parent / "comm", WORLD, model_dir, tp=TP, ep=EP)
