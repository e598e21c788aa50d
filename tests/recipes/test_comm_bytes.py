"""The bytes each rank moves, counted in the collectives (backend.instruments.comm_bytes), are
what parallel.step_traffic's model says for the plan: tp2 x ep2 on 4 gloo ranks here (dp 2,
edp 2: every kind of group moves something), tp4 x ep8 in test_verl_engine_mission_plan.

Tolerances: EP carries the micro-batches' shape agreement (16 bytes each) and DP megatron's
bucket padding, which the model leaves out; TP and the weight sync are exact.
"""

import json
import os
from pathlib import Path

import pytest

from backend.instruments import comm_bytes
from tests.support.multiproc import run_ranks

EP_METADATA_BYTES = 256  # <= 16 bytes a micro-batch of shape agreement
DP_PADDING = 0.01  # megatron pads each gradient bucket


def comm_env(monkeypatch_or_ctx, out: Path) -> None:
    monkeypatch_or_ctx.setenv(comm_bytes.ENV, str(out))
    monkeypatch_or_ctx.setenv(comm_bytes.FR_BUFFER_ENV, str(comm_bytes.FR_BUFFER))


def first_rows(out: Path, rank: int) -> dict[str, dict]:
    """The first old_log_prob / weight_sync / update rows of a rank's file."""
    rows = {}
    for line in (out / f"rank{rank}.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["phase"], row)
    return rows


def assert_model_matches(
    out: Path, world: int, model_dir, tp: int, ep: int, recompute: str = "none"
) -> None:
    """Every rank's measured bytes against parallel.step_traffic for the plan."""
    from backend.qwen3_moe.config import load_qwen3_moe_spec
    from parallel.plan import ParallelPlan, check_against_model
    from parallel.step_traffic import Settings, StepTokens, step_bytes

    fit = check_against_model(
        ParallelPlan.for_world(world, tp=tp, ep=ep), load_qwen3_moe_spec(model_dir)
    )
    for rank in range(world):
        rows = first_rows(out, rank)
        tokens = StepTokens(rows["old_log_prob"]["tokens"], rows["update"]["tokens"])
        model = step_bytes(fit, tokens, Settings(4, recompute=recompute))
        for phase in ("old_log_prob", "update", "weight_sync"):
            got, want = rows[phase]["bytes"], model[phase]
            where = f"rank {rank} {phase} at tp{tp} x ep{ep}: {got} against {want}"
            assert got["tp"] == want["tp"], where
            assert 0 <= got["ep"] - want["ep"] <= EP_METADATA_BYTES, where
            assert want["dp"] <= got["dp"] <= want["dp"] * (1 + DP_PADDING) + 64, where
        assert model["update"]["dp"] > 0 and model["update"]["ep"] > 0 and model["update"]["tp"] > 0


def probe_rank(rank: int, hf_dir: str, tp: int, ep: int, recompute: str) -> int:
    """One old-log-prob pass, the weight stream, one DAPO update: what a step runs."""
    os.environ["VERL_ENGINE_DEVICE"] = "cpu"
    from backend.platform.device import prepare_device

    prepare_device("cpu")
    from verl.workers.utils.padding import response_from_nested

    from tests.recipes.test_verl_engine import build_engine
    from tests.recipes.test_verl_engine_multiproc import _batch, _loss

    engine = build_engine(hf_dir, tp=tp, ep=ep, recompute=recompute)
    data = _batch(2, engine.get_data_parallel_rank())
    with engine.eval_mode():
        old = engine.infer_batch(data)["model_output"]["log_probs"]
    data["old_log_probs"] = response_from_nested(old, data["response_mask"])
    dict(engine.get_per_tensor_param()[0])
    with engine.train_mode():
        engine.train_batch(data, loss_function=_loss())
    return rank


@pytest.mark.slow
def test_tp2_ep2_moves_what_the_traffic_model_says(tmp_path, monkeypatch):
    """With full recompute, as the CPU run trains beyond world 4 (tp4 x ep8 without it: the mission plan's
    test). Catches a collective on the wrong group (megatron's dispatch group counted as TP),
    a phase that moves more than its plan needs (a second weight gather, a gradient all-reduce
    where a reduce-scatter is due), and a model that forgot a term."""
    from tests.recipes.test_verl_engine_mission_plan import SHAPE
    from tests.support.model_dirs import built

    model_dir = built(tmp_path / "model", SHAPE)
    out = tmp_path / "comm"
    comm_env(monkeypatch, out)
    assert run_ranks(probe_rank, 4, str(model_dir), 2, 2, "full", timeout=600) == [0, 1, 2, 3]
    assert_model_matches(out, 4, model_dir, tp=2, ep=2, recompute="full")


def entry(op: str, inputs, outputs, dtype="Float", group=("3", "TENSOR_MODEL_PARALLEL_GROUP")):
    return {"profiling_name": f"gloo:{op}", "input_sizes": inputs, "input_dtypes": [dtype],
            "output_sizes": outputs, "output_dtypes": [dtype], "process_group": group}  # fmt: skip


def test_a_collectives_bytes_are_its_larger_buffer():
    """An all-gather counts its gathered output (also where the recorder shows a list gather's
    output as [1, n]), an all-reduce its input, a group of one nothing; dtypes by width."""
    assert comm_bytes.buffer_bytes(entry("all_gather", [[8, 2]], [[4, 8, 2]]), 4) == 256
    assert comm_bytes.buffer_bytes(entry("all_gather", [[100]], [[1, 100]]), 2) == 800
    assert comm_bytes.buffer_bytes(entry("all_reduce", [[3, 5]], [[3, 5]], "BFloat16"), 8) == 30
    assert comm_bytes.buffer_bytes(entry("all_reduce", [[64]], [[64]], "Bool"), 2) == 64
    assert comm_bytes.buffer_bytes(entry("all_reduce", [[1000]], [[1000]]), 1) == 0


def test_groups_are_told_apart_by_ours_then_megatrons_description():
    """Our ProcessGroups' names first; megatron-core's dispatch group (tp x ep) is EP; a
    group nobody names (verl's world) is 'other'."""
    ours = {"5": "tp", "9": "dp"}
    assert comm_bytes.kind_of(("5", "undefined"), ours) == "tp"
    assert comm_bytes.kind_of(("12", "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP"), ours) == "ep"
    assert comm_bytes.kind_of(("14", "EXPERT_DATA_PARALLEL_GROUP"), ours) == "dp"
    assert comm_bytes.kind_of(("0", "default_pg"), ours) == "other"


def test_the_counter_refuses_without_the_recorder(monkeypatch, tmp_path):
    """On without TORCH_FR_BUFFER_SIZE it would count nothing and report zeros: it says so."""
    monkeypatch.setenv(comm_bytes.ENV, str(tmp_path))
    monkeypatch.delenv(comm_bytes.FR_BUFFER_ENV, raising=False)
    with pytest.raises(RuntimeError, match="needs TORCH_FR_BUFFER_SIZE set"):
        comm_bytes.CommBytes.from_env(groups=None)
    monkeypatch.delenv(comm_bytes.ENV)
    assert comm_bytes.CommBytes.from_env(groups=None) is None


def test_a_ring_that_dropped_collectives_is_refused(monkeypatch, tmp_path):
    """A phase with more collectives than the recorder's ring would count only its tail: the
    counter says so instead of writing too few bytes."""
    import torch._C._distributed_c10d as c10d

    def dump(record_ids):
        entries = [{"record_id": i, **entry("all_reduce", [[4]], [[4]])} for i in record_ids]
        return lambda *args: json.dumps({"entries": entries}).encode()

    counter = comm_bytes.CommBytes(tmp_path, {}, rank=0, sizes={"3": 2}, seen=9)
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", dump(range(8, 14)))
    assert counter.take("update")["bytes"]["tp"] == 4 * 16  # records 10-13, 16 bytes each
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", dump(range(20, 25)))  # 14-19 overwritten
    with pytest.raises(RuntimeError, match="ring dropped collectives within one phase"):
        counter.take("update")
