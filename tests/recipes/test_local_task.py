"""The CPU run's toy task: its problems, data files and score; the mini model it can serve."""

import json
import re

import pandas as pd
import pytest

from recipes.local.task.doubles import compute_score, make_problems, write_data

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def test_doubles_one_per_answer_both_digits_name_it():
    problems = make_problems(3)
    assert [(p.prompt, p.answer) for p in problems] == [
        ("0+0=", "0"), ("1+1=", "2"), ("2+2=", "4"), ("3+3=", "6")
    ]  # fmt: skip
    assert len({p.answer for p in make_problems(4)}) == 5


def test_answers_beyond_one_digit_are_refused():
    with pytest.raises(ValueError, match="single digit"):
        make_problems(5)


def test_data_files_hold_the_problems_in_verls_columns(tmp_path):
    paths = write_data(tmp_path, max_operand=2, repeats=4)
    train, val = pd.read_parquet(paths["train"]), pd.read_parquet(paths["val"])
    assert len(train) == 12 and len(val) == 3
    assert [m[0]["content"] for m in val["prompt"]] == ["0+0=", "1+1=", "2+2="]
    assert [r["ground_truth"] for r in val["reward_model"]] == ["0", "2", "4"]
    assert set(train["data_source"]) == {"math_dapo"}


@pytest.mark.parametrize(
    "response, score",
    [("2", 1.0), ("2\n", 1.0), ("2+", 1.0), ("12", -1.0), ("", -1.0), ("x2", -1.0)],
)
def test_score_reads_the_leading_digits(response, score):
    assert compute_score("math_dapo", response, "2")["score"] == score


def test_mini_checkpoint_with_the_tasks_tokenizer_is_one_vllms_cpu_backend_serves(tmp_path):
    """The mini model as the local run would serve it (its checkpoint and the task's character
    tokenizer in one folder): no limit of vLLM's CPU backend hit at the run's rollout TP, its
    vocabulary and special ids the tokenizer's, Qwen3-30B-A3B's routing and GQA kept, its
    layers split by pp 2 and 4, and the pad token's embedding row drawn (a zero row made the
    first update's gradient an outlier: tests/recipes/test_first_update.py). Catches a size that vLLM
    pads or refuses (head_dim, hidden or expert slice off 32) or a vocabulary the tokenizer
    does not name."""
    from transformers import AutoTokenizer

    from backend.qwen3_moe import load_qwen3_moe_spec
    from converters.hf_io import read_state_dict
    from recipes.local.cpu.rollout_limits import problems
    from recipes.local.task.doubles import VOCAB_SIZE, write_tokenizer
    from recipes.local.task.hf_checkpoints import make_checkpoint

    hf_dir = write_tokenizer(make_checkpoint(tmp_path / "mini", "mini", seed=0))
    assert [problems(hf_dir, tp) for tp in (1, 2, 4)] == [[], [], []]  # tp 4: the mission's
    assert problems(hf_dir, 8) == []  # vLLM replicates the 4 KV heads
    assert "rollout TP 3 does not divide its 32 attention heads" in problems(hf_dir, 3)[0]
    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert config["vocab_size"] == len(tokenizer) == VOCAB_SIZE
    assert (config["pad_token_id"], config["eos_token_id"]) == (
        tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")
    )  # fmt: skip
    spec = load_qwen3_moe_spec(hf_dir)  # either spelling of the expert count
    assert (spec.num_experts, spec.top_k, spec.norm_topk_prob) == (128, 8, True)
    assert (spec.num_heads, spec.num_kv_heads) == (32, 4)  # Qwen3-30B-A3B's: tp 4 divides them
    assert spec.num_layers % 4 == 0
    pad_row = read_state_dict(hf_dir)["model.embed_tokens.weight"][config["pad_token_id"]]
    assert pad_row.norm() > 0.1  # a drawn row of 128 at std 0.02: ~0.23


def test_sums_write_their_working_and_verls_scorer_grades_the_answer_line():
    """The mini model's task: a line per addition, then DAPO's "Answer: N", graded by verl's
    own math_dapo (no scorer of ours). Catches working that skips a running total, an answer
    line verl's Minerva parser does not read, or a single operand given working."""
    from verl.utils.reward_score import default_compute_score

    from recipes.local.task.sums import Sum

    s = Sum((2, 1, 3))
    assert (s.prompt, s.working, s.answer) == ("2+1+3=", "2+1=3\n3+3=6\nAnswer: 6", "6")
    assert Sum((4,)).working == "Answer: 4"
    assert default_compute_score("math_dapo", s.working, "6")["acc"] is True
    assert default_compute_score("math_dapo", "2+1=3\n3+3=7\nAnswer: 7", "6")["acc"] is False


def test_sums_response_lengths_vary_4x_within_a_batch(tmp_path):
    """The issue's shape: responses whose lengths vary at least 4x within a train batch (8
    prompts), the longest inside max_response_length without the overlong buffer, every
    running total a single digit. Catches a task whose answers are all one length, or
    whose longest answer the overlong buffer would penalise."""
    from transformers import AutoTokenizer

    from recipes.local.cpu_overrides import SUMS
    from recipes.local.task.doubles import write_tokenizer
    from recipes.local.task.sums import MAX_RESPONSE_TOKENS, draw_sums

    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok"))
    sums = draw_sums(512, seed=0)
    lengths = [len(tok(s.working)["input_ids"]) + 1 for s in sums]  # + <|im_end|>
    assert (min(lengths), max(lengths)) == (10, MAX_RESPONSE_TOKENS)
    assert MAX_RESPONSE_TOKENS <= SUMS["max_response_length"] - SUMS["overlong_buffer"]
    assert all(sum(s.operands) <= 9 for s in sums)
    batches = [lengths[i : i + 8] for i in range(0, len(lengths), 8)]
    spread = sorted(max(b) / min(b) for b in batches)
    assert spread[len(spread) // 2] >= 2.5 and spread[-1] >= 4  # median batch and widest
    prompts = [len(tok.apply_chat_template([{"role": "user", "content": s.prompt}],
                                           add_generation_prompt=True)) for s in sums]  # fmt: skip
    assert max(prompts) <= SUMS["max_prompt_length"]


def test_sums_data_files_rl_and_sft_in_verls_columns(tmp_path):
    from recipes.local.task.sums import write_sums_data

    paths = write_sums_data(tmp_path, train=20, val=6, sft=10)
    train, val, sft = (pd.read_parquet(paths[k]) for k in ("train", "val", "sft"))
    assert (len(train), len(val), len(sft)) == (20, 6, 10)
    assert set(train["data_source"]) == {"math_dapo"}
    first = sft["messages"][0]
    assert [m["role"] for m in first] == ["user", "assistant"]
    operands = map(int, first[0]["content"].removesuffix("=").split("+"))
    assert first[1]["content"].endswith(f"Answer: {sum(operands)}")


def test_the_warmups_corpus_answers_half_the_long_sums_by_a_guess():
    """The warm-up leaves RL a policy that either works the sum out (right) or guesses the
    answer line (right one time in ten): what RL has to learn is the choice, so validation
    climbs from a low start. Catches a corpus without guesses (RL would start at its ceiling),
    a one-operand sum guessed (its answer line is its working), a worked answer changed."""
    from recipes.local.task.sums import Sum, draw_sums, sft_rows

    sums = draw_sums(2000, seed=2)
    rows = sft_rows(sums, guess_share=0.5, seed=3)
    guesses = []
    for s, row in zip(sums, rows, strict=True):
        user, reply = (m["content"] for m in row["messages"])
        assert user == s.prompt
        if reply != s.working:
            assert len(s.operands) > 1 and re.fullmatch(r"Answer: \d", reply), (s, reply)
            guesses.append(int(reply.removeprefix("Answer: ")) == sum(s.operands))
    multi = sum(len(s.operands) > 1 for s in sums)
    assert 0.45 < len(guesses) / multi < 0.55
    assert 0.05 < sum(guesses) / len(guesses) < 0.15  # a guess is right about one time in ten
    assert [r["messages"][1]["content"] for r in sft_rows(sums, 0.0, 3)] == [
        s.working for s in sums
    ]
    assert Sum((2, 1, 3)).working == "2+1=3\n3+3=6\nAnswer: 6"


def test_guessing_sums_differ_from_the_default_in_their_teacher_and_validation_only():
    """`--task guessing_sums` (the modes' ranking task): the default's sums and RL settings, a
    corpus that guesses 80% of the sums of two or more operands, and a validation set where one
    flipped answer moves the mean by at most 0.005. Catches a variant that also changes the
    table or the RL settings (a ranking would then not be on the task the run trains), or a
    validation set too small to rank."""
    from recipes.local.cpu_overrides import GUESSING_SUMS, SUMS
    from recipes.local.task import sums

    task = sums.GUESSING_SUMS
    assert (task.max_operands, task.max_digit, task.max_sum) == (6, 3, 9)
    assert (task.guess_share, sums.SUMS.guess_share) == (0.8, 0.5)
    assert 1 / (task.val * GUESSING_SUMS["val_n"]) <= 0.005 and sums.SUMS.val == 16
    changed = {k for k in SUMS if SUMS[k] != GUESSING_SUMS[k]}
    assert changed == {"run_name", "steps"} and GUESSING_SUMS["steps"] == 40
    assert sums.SUMS.max_response_tokens == sums.MAX_RESPONSE_TOKENS == 40


def test_the_guessing_corpus_guesses_four_long_sums_in_five(tmp_path):
    """The variant's files: task.json names it (the launcher remakes data of another task), 32
    validation prompts, the same train sums as the default's, and four in five of the warm-up's
    long sums guessed. Catches a corpus the share never reached, or train data drawn apart
    from the default's (the variant's runs would then differ in more than the warm-up)."""
    import json

    from recipes.local.task import sums

    default = sums.write_sums_data(tmp_path / "d", train=64, sft=2000)
    paths = sums.write_sums_data(tmp_path / "g", train=64, sft=2000, task=sums.GUESSING_SUMS)
    assert json.loads((tmp_path / "g" / "task.json").read_text())["task"] == "guessing_sums"
    assert len(pd.read_parquet(paths["val"])) == 32
    assert pd.read_parquet(paths["train"]).equals(pd.read_parquet(default["train"]))
    conversations = pd.read_parquet(paths["sft"])["messages"]
    long = [m for m in conversations if "+" in m[0]["content"]]
    guessed = [m for m in long if "\n" not in m[1]["content"]]
    assert 0.77 < len(guessed) / len(long) < 0.83
