"""The side by side's per-rank memory rows, from the probe's lines."""

import json

from scripts.bench.launches.memory_breakdown import breakdown, memory_table, rank_breakdown


def _line(point, rss, hwm, **held):
    return {"point": point, "rss_mib": rss, "anon_mib": rss - 100, "file_mib": 100,
            "hwm_mib": hwm, **held}  # fmt: skip


HELD = dict(params_mib=30.0, grads_mib=30.0)
LINES = [
    _line("first_forward", 700, 720),
    _line("pre_step", 760, 900, optimizer_states_mib=0.0, step=1, **HELD),  # pass: 900 - 700
    _line("post_step", 820, 830, optimizer_states_mib=60.0, step=1, **HELD),
    _line("pre_step", 830, 990, optimizer_states_mib=60.0, step=2, **HELD),  # 990 - 820
    _line("post_step", 850, 860, optimizer_states_mib=60.0, step=2, heap_free_mib=25.0, **HELD),
]


def test_a_ranks_row():
    """Bugs caught: the first step's states (none yet) taken for the rank's, a pass peak taken
    against the wrong baseline, the growth after the first forward left unexplained."""
    row = rank_breakdown(LINES)
    assert row["at_first_forward"] == 700 and row["base_less_params"] == 670
    assert (row["params"], row["grads"], row["optimizer_states"]) == (30, 30, 60)
    assert (row["between_steps"], row["anon"], row["file"]) == (850, 750, 100)
    assert row["kept_beyond_states"] == 850 - 700 - 30 - 60
    assert row["heap_free"] == 25 and row["kept_in_use"] == 60 - 25  # glibc's retained part
    assert row["pass_peak"] == 200 and row["peak"] == 990 and row["optimizer_steps"] == 2
    assert rank_breakdown(LINES[:2]) is None  # no completed step: no row


def test_only_the_launchs_ranks_and_a_column_per_rank(tmp_path):
    for pid in (11, 12, 99):  # 99: a process of another job, or the warm-up's
        (tmp_path / f"{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in LINES))
    rows = breakdown(tmp_path, {"12": 900, "11": 910, "13": 800})  # 13 left no lines
    assert [r["pid"] for r in rows] == [11, 12]
    text = memory_table(
        {"mini/world2": {"fsdp": {"memory": rows}, "mcore_ep": {"memory": rows[:1]}}}
    )
    assert "| | FSDP rank 0 | FSDP rank 1 | ours rank 0 |" in text
    assert "| kept_beyond_states | 60 | 60 | 60 |" in text
    no_heap = rank_breakdown([{k: v for k, v in x.items() if k != "heap_free_mib"} for x in LINES])
    assert no_heap["heap_free"] is None and no_heap["kept_in_use"] is None  # an older probe
    assert "| heap_free | - |" in memory_table({"w": {"fsdp": {"memory": [no_heap]}}})
