"""The local DAPO recipe: reward, dynamic sampling, policy-loss wiring, a short run, its resume."""

import json
import shutil

import numpy as np
import pytest
import torch

from recipes.local import algorithm
from recipes.local.rollout import Layout, assemble
from recipes.local.task import CharTokenizer, make_problems, prompt_batch, reward_manager

R, BUFFER, PENALTY = 4, 2, 1.0


def scored(prompt: str, answer: str, responses: list[str]):
    """Run the DAPO reward manager on hand-written responses ("<eos>" marks the end)."""
    from verl import DataProto

    from recipes.local.task import Problem

    tok = CharTokenizer()
    layout = Layout.for_tp(len(prompt), R, 1)
    ids = [
        tok.encode(r.replace("<eos>", "")) + [tok.eos_token_id] * r.endswith("<eos>")
        for r in responses
    ]
    responses_NR = torch.tensor([x + [tok.pad_token_id] * (R - len(x)) for x in ids])
    prompts = prompt_batch([Problem(prompt, answer)] * len(responses), tok)
    tensors = assemble(
        prompts.pop("prompt_ids_BP"), responses_NR, layout, tok.eos_token_id, tok.pad_token_id
    )
    data = DataProto.from_dict(tensors=tensors, non_tensors=prompts)
    return reward_manager(tok, R, BUFFER, PENALTY)(data, return_dict=True)


def test_reward_correct_wrong_and_overlong():
    responses = ["7<eos>", "8<eos>", "=7<eos>", "7777"]
    out = scored("3+4=", "7", responses)
    lengths = [2, 2, 3, 4]  # response tokens, EOS included; the last one is truncated
    expected_score = [1.0, -1.0, 1.0, -1.0]  # math_dapo reads "Answer: =7" as 7
    for i, (length, score) in enumerate(zip(lengths, expected_score, strict=True)):
        overlong = min(-(length - (R - BUFFER)) / BUFFER * PENALTY, 0.0)
        row = out["reward_tensor"][i]
        assert row[length - 1].item() == pytest.approx(score + overlong), responses[i]
        assert row.abs().sum().item() == pytest.approx(abs(score + overlong))  # last token only
    assert [bool(a) for a in out["reward_extra_info"]["acc"]] == [True, False, True, False]


def test_problems_have_single_digit_answers_and_fixed_prompt_length():
    problems = make_problems("+-", 9)
    assert len(problems) == 110  # 55 sums <= 9 and 55 differences >= 0
    assert {len(p.prompt) for p in problems} == {4}
    assert all(p.answer.isdigit() and len(p.answer) == 1 for p in problems)
    with pytest.raises(ValueError, match="unknown operator"):
        make_problems("/")


def test_balanced_stream_repeats_rare_answers():
    from collections import Counter

    from recipes.local.task import balanced

    problems = make_problems("+", 4)  # sums 0..8: "0+0=" alone answers 0, five prompts answer 4
    stream = balanced(problems)
    assert Counter(p.prompt for p in stream)["0+0="] == 5
    per_answer = Counter(p.answer for p in stream)  # 5:1 before; integer repeats leave <= 3:2
    assert max(per_answer.values()) / min(per_answer.values()) <= 1.5


def groups_data(acc_per_group: list[list[bool]], tag: str = ""):
    """A DataProto with one row per response: uid per group, acc, a row-id tensor."""
    from verl import DataProto

    uids = [f"{tag}{g}" for g, accs in enumerate(acc_per_group) for _ in accs]
    acc = [a for accs in acc_per_group for a in accs]
    return DataProto.from_dict(
        tensors={"row": torch.arange(len(acc))},
        non_tensors={"uid": np.array(uids, dtype=object), "acc": np.array(acc)},
    )


def test_filter_groups_drops_groups_whose_acc_is_all_equal():
    data = groups_data(
        [[True] * 4, [True, False, False, False], [False] * 4, [False, True, True, True]]
    )
    kept, num = algorithm.filter_groups(data, "acc")
    assert num == 2
    assert kept.non_tensor_batch["uid"].tolist() == ["1"] * 4 + ["3"] * 4
    assert kept.batch["row"].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


def test_dynamic_sampling_keeps_generating_until_the_batch_is_full():
    batches = iter(
        [
            groups_data([[True] * 2, [False] * 2], "a"),  # nothing survives
            groups_data([[True, False], [True] * 2], "b"),  # one group
            groups_data([[False, True], [True, False]], "c"),
        ]
    )  # two: one over the need
    sampled = algorithm.collect_train_batch(
        lambda: next(batches), train_prompts=2, n=2, max_num_gen_batches=5
    )
    assert sampled.num_gen_batches == 3 and sampled.num_prompts == 2
    assert sampled.batch.non_tensor_batch["uid"].tolist() == ["b0", "b0", "c0", "c0"]
    assert len(sampled.rollouts) == 3


def test_dynamic_sampling_stops_at_max_num_gen_batches_keeping_whole_mini_batches():
    solved = algorithm.collect_train_batch(
        lambda: groups_data([[True] * 2] * 3), train_prompts=2, n=2, max_num_gen_batches=3
    )
    assert solved.num_gen_batches == 3 and solved.batch is None
    batches = iter([groups_data([[True, False], [False, True], [True, False]], t) for t in "ab"])
    partial = algorithm.collect_train_batch(
        lambda: next(batches), train_prompts=8, n=2, max_num_gen_batches=2, mini_prompts=4
    )
    assert partial.num_prompts == 4 and len(partial.batch) == 8  # 6 kept, one mini-batch of 4


def test_policy_loss_is_verls_clip_higher_token_mean_over_the_global_tokens():
    ratios = torch.tensor([[1.25, 1.5, 0.5], [0.7, 1.1, 12.0]])
    advantages = torch.tensor([[1.0] * 3, [-1.0] * 3])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # seq 0's 0.5 is padding
    # clip_low 0.2, clip_high 0.28: 1.25 stays (a symmetric 0.2 would give 1.2), 1.5 -> 1.28;
    # A < 0: max(r, clip(r)) -> 0.8 and 1.1; dual clip caps 12 at clip_ratio_c = 10
    expected = (-1.25 - 1.28 + 0.8 + 1.1 + 10.0) / 5
    loss_fn = algorithm.make_policy_loss(algorithm.policy_loss_config(n=2), slice(0, 3))
    batch = {
        "old_log_probs": torch.zeros(2, 3),
        "advantages": advantages,
        "response_mask": mask,
        "global_tokens": mask.sum(),
    }
    full, _ = loss_fn(ratios.log(), batch)
    halves = [
        loss_fn(
            ratios.log()[i : i + 1], {k: (v[i : i + 1] if v.ndim else v) for k, v in batch.items()}
        )
        for i in range(2)
    ]
    assert full.item() == pytest.approx(expected, rel=1e-6)
    assert sum(h[0] for h in halves).item() == pytest.approx(expected, rel=1e-6)
    # each micro-batch divides by the global 5 tokens, not its own 2 or 3
    assert halves[0][0].item() == pytest.approx((-1.25 - 1.28) / 5, rel=1e-6)


def test_rank_micro_batches_split_dp_ranks_evenly_with_masked_padding():
    from verl import DataProto

    rows = 10
    tensors = {k: torch.ones(rows, 3) for k in algorithm.TRAIN_KEYS}
    mini = DataProto.from_dict(tensors=tensors)
    per_rank = [algorithm.rank_micro_batches(mini, 2, 2, r) for r in range(2)]
    assert [len(m) for m in per_rank] == [3, 3]  # 5 rows each -> 6 in micro-batches of 2
    assert per_rank[1][-1]["response_mask"].sum() == 0  # the padding row counts no token
    assert all(mb["global_tokens"] == rows * 3 for mbs in per_rank for mb in mbs)


# at chance almost every group is all-wrong: filter on the shaped reward so each step updates
SMALL = [
    "--n",
    "4",
    "--gen-prompts",
    "8",
    "--train-prompts",
    "4",
    "--mini-prompts",
    "2",
    "--micro-size",
    "8",
    "--max-num-gen-batches",
    "2",
    "--filter-metric",
    "seq_final_reward",
    "--no-progress",
]


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _without_time(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time/")}


def test_short_run_writes_outputs_and_resume_reproduces_the_next_step(tmp_path):
    from recipes.local.dapo import main

    out = tmp_path / "run"
    assert main(["--steps", "3", "--save-freq", "2", "--out", str(out), *SMALL]) == 0
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_000003"
    assert {"meta.json", "rank_00.pt"} <= {p.name for p in (ckpts / "step_000002").iterdir()}
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "routing_report" / "index.html").is_file() and (
        out / "reward_curve.png"
    ).is_file()
    from safetensors import safe_open

    with safe_open(out / "export_hf" / "model.safetensors", framework="pt") as f:
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in set(
            f.keys()
        )  # hub per-expert keys
    summary = json.loads((out / "summary.json").read_text())
    assert summary["export_max_logits_diff"] < 1e-4  # transformers reloads the export
    report = json.loads((out / "routing_report.json").read_text())
    assert report["meta"]["steps"] == 3 and report["phases"]["update"]["cumulative"]

    original = _rows(out)
    assert [r["step"] for r in original] == [1, 2, 3]
    # killed after the step-2 checkpoint: step 3 is lost, the rerun must redo it bit for bit
    shutil.rmtree(ckpts / "step_000003")
    (ckpts / "latest").write_text("step_000002")
    assert main(["--steps", "3", "--save-freq", "2", "--out", str(out), "--resume", *SMALL]) == 0
    resumed = _rows(out)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert _without_time(resumed[2]) == _without_time(original[2])
    assert "actor/grad_norm" in original[2]  # the compared step did update the policy
    with pytest.raises(Exception, match="written with"):
        main(["--steps", "4", "--out", str(out), "--resume", *SMALL, "--lr", "1"])
    # without --resume the directory starts over: no stale rows or checkpoints remain
    assert main(["--steps", "1", "--out", str(out), *SMALL]) == 0
    assert [r["step"] for r in _rows(out)] == [1]
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000001"]
