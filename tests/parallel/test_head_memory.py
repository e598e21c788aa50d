"""parallel/'s model of the log-prob head: full logits vs the lean head, and the dry run's line."""

import pytest

from parallel.head_memory import CHUNK_BYTES, FULL_PASS_BYTES
from parallel.memory import GIB, MemoryOptions, estimate_memory, format_memory
from parallel.models import load_spec
from parallel.plan import ParallelPlan, check_against_model

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

QWEN = load_spec()


def _fit(**plan):
    return check_against_model(ParallelPlan(**plan), QWEN)


def test_chunk_size_is_the_lean_heads():
    import backend.model.lean_head

    assert CHUNK_BYTES == backend.model.lean_head.CHUNK_BYTES


def test_log_prob_pass_full_logits_and_lean_at_32k_tokens():
    fit = _fit(tp=4, ep=8, nodes=4)
    p = estimate_memory(fit, MemoryOptions(64.0, micro_batch_tokens=16384)).log_prob_pass
    assert p.tokens == 32768  # twice the update's, as recipes/dapo sets it
    # about three fp32 copies of the [T, V/tp] logits (issue #17: ~15 GB at 32K tokens, tp4)
    vocab_local = fit.padded_vocab / 4
    assert p.full_head > 32768 * vocab_local * FULL_PASS_BYTES
    assert p.full_head / GIB == pytest.approx(16.3, abs=0.1)
    assert p.ratio <= 0.5  # issue #17's target, here far below
    assert p.lean_head < 1 * GIB


def test_update_row_follows_the_head_choice():
    fit = _fit(tp=4, ep=8, nodes=4)

    def logits_row(lean):
        est = estimate_memory(fit, MemoryOptions(64.0, lean_heads=lean))
        return next(r for r in est.rows if r.name.startswith("logits"))

    full, lean = logits_row(False), logits_row(True)
    assert "full logits" in full.name and "lean head" in lean.name
    head_inputs = 2 * 8192 / 4 * QWEN.hidden_size * 2
    assert full.update == pytest.approx(8192 * fit.padded_vocab / 4 * 10 + head_inputs)
    # 8K tokens: the chunk buffers and the fp32 weight gradient are most of what is left
    assert lean.update < full.update / 3


def test_planner_and_dry_run_print_the_log_prob_pass():
    from recipes.dapo.job.fit import fit_rollout

    fit = _fit(tp=4, ep=8, nodes=4)
    text = format_memory(estimate_memory(fit, MemoryOptions(64.0)), 1)
    assert "log-prob pass (no grad, entropy, 16384 tokens" in text
    lines = fit_rollout(fit, "npu", 16384, rollout_tp=2).lines()
    assert any(line.startswith("log-prob pass") and "lean" in line for line in lines)
