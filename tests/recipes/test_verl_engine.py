"""The mcore_ep engine through verl's own engine interface, on the tiny Qwen3-MoE (CPU, fp32).

Batches are built the way verl's V1 trainer builds them (list_of_dict_to_tensordict of
per-sequence dicts: nested prompts/responses/input_ids, response-length masks), losses are
verl's own (workers.utils.losses.ppo_loss with DAPO's clip-higher settings), and every
number is checked against transformers' Qwen3MoeForCausalLM on the same weights.
"""

import time
from functools import partial

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import response_from_nested

from backend.qwen3_moe import load_qwen3_moe_spec, unfuse_experts
from backend.shared.integers import round_up
from converters.hf_io import read_state_dict
from converters.table import mcore_to_hf
from recipes.dapo.checkpoints import files
from recipes.dapo.engine import batches, weights
from recipes.dapo.job.overrides import AUX_LOSS
from tests.support.oracles import gather_full

LENGTHS = [(5, 7), (3, 4), (6, 9), (4, 2), (2, 6)]  # (prompt, response) tokens per sequence


def build_engine(hf_dir, aux_loss=None, tp=1, ep=1, recompute=False, fast=False, lr=1e-3,
                 checkpoint_config=None, optimizer_config=None, **config):  # fmt: skip
    """An initialized mcore_ep engine, made the way verl's TrainingWorker makes it (device cpu)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    import recipes.dapo.engine.verl_engine  # noqa: F401  (registers the backend)
    from recipes.dapo.engine.config import McoreEpEngineConfig

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="mcore_ep",
        model_config=HFModelConfig(path=str(hf_dir), load_tokenizer=False),
        engine_config=McoreEpEngineConfig(
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            aux_loss=aux_loss or {"mode": "off"},
            recompute=recompute,
            # the accelerators' modules: GroupedExperts + SDPAttention
            **(dict(experts="grouped", attention="sdpa") if fast else {}),
            **config,  # e.g. param_offload, optimizer_offload
        ),
        optimizer_config=optimizer_config
        or FSDPOptimizerConfig(lr=lr, lr_warmup_steps=4, weight_decay=0.1, clip_grad=1.0),
        checkpoint_config=checkpoint_config or CheckpointConfig(),
    )
    engine.initialize()
    return engine


@pytest.fixture
def make_engine(world1, tiny_hf_dir, monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    return partial(build_engine, tiny_hf_dir)


def dapo_actor_config():
    from recipes.dapo.engine.config import McoreEpActorConfig

    return McoreEpActorConfig(
        rollout_n=1,
        use_dynamic_bsz=True,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=10.0,
        loss_agg_mode="token-mean",
    )


def make_batch(max_tokens=32, seeds=(0,), lengths=None):
    """Per seed, sequences of LENGTHS (or of lengths[i] for seeds[i]; random tokens and
    advantages), as one verl batch."""
    rows = []
    for i, seed in enumerate(seeds):
        rows += _rows(
            torch.Generator().manual_seed(seed), LENGTHS if lengths is None else lengths[i]
        )
    data = tu.list_of_dict_to_tensordict(rows)
    tu.assign_non_tensor(
        data,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=max_tokens,
        temperature=1.0,
        calculate_entropy=False,
        global_batch_size=len(rows),
    )
    return data


def _rows(gen, lengths=LENGTHS):
    rows = []
    for p_len, r_len in lengths:
        prompt, response = (
            torch.randint(0, 128, (p_len,), generator=gen),
            torch.randint(0, 128, (r_len,), generator=gen),
        )
        ids = torch.cat([prompt, response])
        ones = torch.ones(r_len, dtype=torch.long)
        rows.append(
            dict(
                prompts=prompt,
                responses=response,
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                position_ids=torch.arange(len(ids)),
                response_mask=ones,
                loss_mask=ones,
                advantages=torch.randn(r_len, generator=gen),
            )
        )
    return rows


def hf_log_probs_and_entropy(hf_model, data):
    """Per sequence, unpadded: log p(x_{t+1}) and the entropy at each position t."""
    log_probs, entropies = [], []
    for ids in data["input_ids"].unbind():
        logp = torch.log_softmax(hf_model(ids[None]).logits[0].float(), dim=-1)
        picked = logp[:-1].gather(-1, ids[1:, None])[:, 0]
        log_probs.append(torch.cat([picked, picked.new_zeros(1)]))
        entropies.append(-(logp.exp() * logp).sum(-1))
    as_nested = partial(torch.nested.as_nested_tensor, layout=torch.jagged)
    return as_nested(log_probs), as_nested(entropies)


def test_registered_for_cuda_npu_and_cpu_and_selected_on_cpu(monkeypatch):
    from verl.workers.engine import EngineRegistry

    from recipes.dapo.engine.verl_engine import McoreEpEngine

    assert set(EngineRegistry._engines["language_model"]["mcore_ep"]) == {"cuda", "npu", "cpu"}
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    assert EngineRegistry.get_engine_cls("language_model", "mcore_ep") is McoreEpEngine


def test_infer_batch_log_probs_and_entropy_match_transformers(make_engine, tiny_hf_model):
    engine, data = make_engine(), make_batch(max_tokens=24)
    tu.assign_non_tensor(data, calculate_entropy=True)
    with engine.eval_mode():
        out = engine.infer_batch(data)
    with torch.no_grad():
        ref_lp, ref_ent = hf_log_probs_and_entropy(tiny_hf_model, data)
    assert len(out["loss"]) > 1  # several micro-batches, restored to the caller's row order
    for ours, ref, what in (
        (out["model_output"]["log_probs"], ref_lp, "log-prob"),
        (out["model_output"]["entropy"], ref_ent, "entropy"),
    ):
        for row, (a, b) in enumerate(zip(ours.unbind(), ref.unbind(), strict=True)):
            torch.testing.assert_close(
                a[:-1], b[:-1], rtol=1e-4, atol=1e-5, msg=f"{what} row {row}"
            )
    # no next token after the last one: verl never reads it, we keep it 0 whatever the padding
    assert all(row[-1] == 0 for row in out["model_output"]["log_probs"].unbind())


def _on_policy(engine, data):
    with engine.eval_mode():
        log_probs = engine.infer_batch(data)["model_output"]["log_probs"]
    data["old_log_probs"] = response_from_nested(log_probs, data["response_mask"])


def _engine_grads(engine, data, loss_fn):
    with engine.train_mode(zero_grad_on_exit=False):
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(data, loss_fn)
        spec = load_qwen3_moe_spec(engine.model_config.local_path)
        grads = mcore_to_hf(gather_full(engine.module, engine.groups, spec, grads=True), spec)
        engine.optimizer_zero_grad()
    return out, grads


@pytest.mark.parametrize(
    "max_tokens, cluster_settings",
    [(16, False), (64, False), (16, True), (16, "fast"), (16, "selective")],
    ids=["mb16", "mb64", "cluster", "fast-modules", "fast-selective"],
)
def test_dapo_loss_and_gradients_match_transformers(
    make_engine, tiny_hf_model, max_tokens, cluster_settings
):
    """verl's ppo_loss (DAPO clip-higher, token-mean) through the engine = the same loss on HF.

    cluster: the A2/H100 engine settings (full recompute), the aux loss observed rather than
    applied so that the reference is the plain DAPO loss (its gradient: tests/test_aux_loss*)."""
    observed = {**AUX_LOSS, "mode": "observe", "global_counts": "counting_pass"}
    extra = {
        True: dict(recompute=True, aux_loss=observed),
        False: {},
        "fast": dict(fast=True, recompute=True),  # our modules, as on accelerators
        # selective recompute: core attention and our experts' SwiGLU re-run in backward
        "selective": dict(fast=True, recompute="selective"),
    }[cluster_settings]
    engine, data = make_engine(**extra), make_batch(max_tokens=max_tokens)
    _on_policy(engine, data)
    loss_fn = partial(ppo_loss, config=dapo_actor_config())
    out, ours = _engine_grads(engine, data, loss_fn)
    # on policy the ratio is 1: the token-mean of -advantage over all response tokens
    advantages = data["advantages"].values()
    assert sum(out["loss"]) == pytest.approx(-advantages.mean().item(), rel=1e-5)

    tiny_hf_model.zero_grad(set_to_none=True)
    ref_lp, _ = hf_log_probs_and_entropy(tiny_hf_model, data)
    ref_loss, _ = loss_fn(model_output={"log_probs": ref_lp}, data=data)
    ref_loss.backward()
    ref = unfuse_experts({n: p.grad for n, p in tiny_hf_model.named_parameters()})
    tiny_hf_model.zero_grad(set_to_none=True)
    assert ours.keys() == ref.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_rollout_correction_weights_reach_verls_loss(make_engine):
    """verl's rollout correction (TIS / IcePop: algorithm.rollout_correction) hands the actor
    per-token `rollout_is_weights`; they reach verl's loss through the engine's micro-batches
    (mutation: a micro-batch without the key trains as if uncorrected). On policy the ratio
    is 1, so the loss is the token-mean of -advantage x weight."""
    engine, data = make_engine(), make_batch()
    _on_policy(engine, data)
    advantages = data["advantages"]
    weights = advantages.values().new_empty(advantages.values().shape).uniform_(0.5, 1.5)
    data["rollout_is_weights"] = torch.nested.nested_tensor_from_jagged(
        weights, advantages.offsets()
    )
    out, _ = _engine_grads(engine, data, partial(ppo_loss, config=dapo_actor_config()))
    expected = -(advantages.values() * weights).mean().item()
    assert sum(out["loss"]) == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(-advantages.values().mean().item(), rel=1e-3)


def test_train_batch_steps_with_warmup_and_reports_metrics(make_engine):
    engine, data = make_engine(), make_batch()
    _on_policy(engine, data)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=partial(ppo_loss, config=dapo_actor_config()))
        lrs = [engine.optim.lr, engine.lr_scheduler_step()]
    assert lrs == pytest.approx([1e-3 / 4, 2e-3 / 4])  # warm-up over 4 updates
    assert out["metrics"]["grad_norm"] > 0
    assert {"actor/pg_loss", "actor/pg_clipfrac", "moe/update/tokens"} <= out["metrics"].keys()
    assert out["metrics"]["moe/update/tokens"] == [sum(p + r for p, r in LENGTHS)]
    assert all(not torch.equal(before[n], p) for n, p in engine.module.named_parameters())


@pytest.mark.parametrize("kind", ["sequence", "global_batch"])
def test_router_aux_loss_adds_the_reference_gradient(make_engine, world1, tiny_hf_dir, kind):
    """(aux on) - (aux off) of the router gradients under verl's DAPO loss, at world 1, is
    the aux loss's gradient written out by hand (tests/support/aux_gradient.py), and the logged
    per-layer values are its values. Catches the aux gradient scaled to 0 (the scale passed
    to backend.aux_loss.attach.with_aux_grad) or never attached, a wrong loss formula."""
    from tests.support.aux_gradient import assert_aux_gradient, aux_settings, reduced_router_grads
    from tests.support.aux_gradient import reference as aux_reference

    data, loss_fn = make_batch(), partial(ppo_loss, config=dapo_actor_config())
    off = make_engine()
    _on_policy(off, data)
    grads_off = reduced_router_grads(off, data, loss_fn)
    on = reduced_router_grads(make_engine(aux_loss=aux_settings(kind)), data, loss_fn)
    assert on[0]["moe/aux_loss/applied"] == [1.0]
    assert_aux_gradient(on, grads_off, aux_reference(world1, tiny_hf_dir, kind, data))


GLOBAL_BATCH = {"mode": "on", "type": "global_batch", "coeff": 1e-2}


def test_global_counts_from_the_old_log_prob_pass_equal_the_counting_pass(
    make_engine, world1, tiny_hf_dir
):
    """One update per trainer step (the weights of the old-log-prob pass): the f counts the
    update uses are the old-log-prob pass's, and equal the counting pass's, exactly; so are
    the aux loss and every gradient, and the router gradient the aux loss adds is the
    reference's (tests/support/aux_gradient.py). Catches stale or partial counts (a difference), and
    an aux gradient that never reaches the routers (scaled to 0: both runs would agree)."""
    from tests.support.aux_gradient import assert_aux_gradient, aux_settings, reduced_router_grads
    from tests.support.aux_gradient import reference as aux_reference

    runs, loss_fn = {}, partial(ppo_loss, config=dapo_actor_config())
    for counts in ("counting_pass", "old_log_prob"):
        engine = make_engine(aux_loss=aux_settings("global_batch", global_counts=counts))
        data = make_batch()
        _on_policy(engine, data)
        hook = engine.routing.hook
        old = hook.step_counts
        out, grads = _engine_grads(engine, data, loss_fn)
        runs[counts] = (old, (hook._count_LE, hook._count_tokens_L), out["metrics"], grads)
    (no_old, counted, metrics, grads), (old, used, olp_metrics, olp_grads) = runs.values()
    assert no_old is None
    assert all(torch.equal(a, b) for a, b in zip(used, old, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(counted, old, strict=True))
    key = "moe/aux_loss/load_balancing/mean"
    assert olp_metrics[key] == metrics[key] and metrics[key][0] > 0
    assert olp_grads.keys() == grads.keys()
    assert all(torch.equal(olp_grads[n], grads[n]) for n in grads)
    off = reduced_router_grads(make_engine(), data, loss_fn)  # the old-log-prob counts kept
    on = reduced_router_grads(engine, data, loss_fn)
    assert_aux_gradient(on, off, aux_reference(world1, tiny_hf_dir, "global_batch", data))


def test_old_log_prob_counts_serve_one_trainer_step(make_engine):
    """Kept over the trainer step's updates, dropped after its last: an update without a new
    old-log-prob pass is refused rather than fed last step's counts."""
    engine = make_engine(aux_loss={**GLOBAL_BATCH, "global_counts": "old_log_prob"})
    data, loss_fn = make_batch(), partial(ppo_loss, config=dapo_actor_config())
    _on_policy(engine, data)
    with engine.train_mode():
        tu.assign_non_tensor(data, update_lr_scheduler=False)
        engine.train_batch(data, loss_function=loss_fn)
        assert engine.routing.hook.step_counts is not None
        tu.assign_non_tensor(data, update_lr_scheduler=True)
        engine.train_batch(data, loss_function=loss_fn)
        assert engine.routing.hook.step_counts is None
        with pytest.raises(RuntimeError, match="old-log-prob pass skipped"):
            engine.train_batch(data, loss_function=loss_fn)


def test_aux_loss_settings_are_the_ones_the_readme_states():
    """The engine default and the cluster recipe's setting, as their startup log lines."""
    from pathlib import Path

    from backend.aux_loss import AuxLossConfig
    from recipes.dapo.engine.config import McoreEpEngineConfig

    readme = " ".join((Path(__file__).parents[2] / "docs" / "aux_loss.md").read_text().split())
    default = AuxLossConfig(**McoreEpEngineConfig().aux_loss).describe()
    cluster = AuxLossConfig(**AUX_LOSS).describe()
    assert f"engine default `{default}`" in readme
    assert f"cluster recipe `{cluster}`" in readme


def test_per_tensor_param_streams_the_hf_checkpoint(make_engine, tiny_hf_dir):
    engine = make_engine()
    stream, peft = engine.get_per_tensor_param()
    assert peft is None
    ours = dict(stream)
    ref = unfuse_experts(read_state_dict(tiny_hf_dir))
    assert ours.keys() == ref.keys()
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("fast", [False, True], ids=["mcore-local", "grouped-sdpa"])
def test_checkpoint_round_trip_and_export_with_our_converter(
    make_engine, tiny_hf_dir, tmp_path, fast, caplog
):
    """Save, export, load: the same tensors each way; the load's log line names the
    checkpoint's step, update and the loaded weights' norm (a no-op load logs the HF one)."""
    from converters.cli import main as converters_main

    engine, data = make_engine(fast=fast), make_batch()
    _on_policy(engine, data)
    with engine.train_mode():
        engine.train_batch(data, loss_function=partial(ppo_loss, config=dapo_actor_config()))
        engine.lr_scheduler_step()
    trained = dict(engine.get_per_tensor_param()[0])
    root = tmp_path / "global_step_1" / "actor"
    engine.save_checkpoint(str(root), global_step=1)
    for name in (
        "meta.json",
        "optim/dist_ckpt/.metadata",
        "optim/dist_ckpt/schedule.json",
        "optim/dist_ckpt/manifest.json",
        "moe_report.json",
        "model/dist_ckpt/hf_config.json",
        "model/dist_ckpt/manifest.json",
    ):
        assert (root / name).is_file(), name

    # the documented export: python -m converters mcore-to-hf <actor dir> OUT --template HF_DIR
    out = tmp_path / "hf_export"
    assert (
        converters_main(
            ["mcore-to-hf", str(root), str(out), "--template", str(tiny_hf_dir), "--no-progress"]
        )
        == 0
    )
    exported = unfuse_experts(read_state_dict(out))
    assert exported.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name

    fresh = make_engine(fast=fast)
    fresh.load_checkpoint(str(root))
    step, update, norm = loaded_line(caplog.text, root)
    assert (step, update) == (1, 1)
    assert norm == pytest.approx(weights_norm_of(trained.values()), rel=1e-9)
    assert dict(fresh.get_per_tensor_param()[0]).keys() == trained.keys()
    for name, tensor in fresh.get_per_tensor_param()[0]:
        assert torch.equal(tensor, trained[name]), name
    assert fresh.optim.lr == pytest.approx(engine.optim.lr)
    state = [s for o in fresh.optim.chained() for s in o.optimizer.state.values()]
    assert state and all(s["step"] == 1 for s in state)

    # the other expert module: the weights load, its optimizer state is refused in one line
    other = make_engine(fast=not fast)
    with pytest.raises(weights.CheckpointError, match="experts setting") as err:
        other.load_checkpoint(str(root))
    assert "\n" not in str(err.value)
    weights.load_model(other.module, root / files.MODEL_DIR)
    for name, tensor in other.get_per_tensor_param()[0]:
        assert torch.equal(tensor, trained[name]), name


def loaded_line(log: str, root) -> tuple[int, int, float]:
    """(global step, optimizer update, weights norm) of the engine's line on loading root."""
    import re

    found = re.findall(
        rf"mcore_ep: resumed from {re.escape(str(root))}: global step (\d+), optimizer update "
        r"(\d+), weights norm (\S+) ",
        log,
    )
    assert len(found) == 1, f"{len(found)} load lines for {root}"
    step, update, norm = found[0]
    return int(step), int(update), float(norm)


def weights_norm_of(tensors) -> float:
    """L2 norm of all the tensors together, in float64."""
    return sum(float(t.double().square().sum()) for t in tensors) ** 0.5


def test_checkpoint_from_another_plan_is_refused_with_one_line(make_engine, tmp_path):
    import json

    from backend.shared.errors import CheckpointError

    engine = make_engine()
    root = tmp_path / "actor"
    engine.save_checkpoint(str(root), global_step=3)
    meta = json.loads((root / "meta.json").read_text())
    meta["plan"]["tp"] = 4
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="same plan") as err:
        engine.load_checkpoint(str(root))
    assert "\n" not in str(err.value)


def test_micro_batches_respect_the_padded_token_budget():
    from recipes.dapo.engine.batches import BatchError, plan_by_tokens, split_to

    lengths = [12, 7, 15, 6, 8, 3]
    plans = plan_by_tokens(lengths, budget=32, multiple=4)
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))
    for plan in plans:  # rows x longest row (rounded up to the multiple) within the budget
        assert len(plan) * round_up(max(lengths[i] for i in plan), 4) <= 32
    assert len(split_to(plans, len(plans) + 2)) == len(plans) + 2
    with pytest.raises(BatchError, match="exceeds max_token_len_per_gpu=8"):
        plan_by_tokens(lengths, budget=8, multiple=1)
    with pytest.raises(BatchError, match="cannot make 7 micro-batches"):
        split_to([[0], [1]], 7)


@pytest.mark.parametrize(
    "damage", ["flipped byte", "crafted .metadata", "no manifest", "crafted data.pt"]
)
def test_resume_refuses_a_damaged_or_crafted_checkpoint_in_one_line(damage, make_engine, tmp_path):
    """Resume reads nothing megatron would unpickle before the manifest and allow-list pass,
    nor lets verl unpickle its data.pt (verl loads it once load_checkpoint has returned)."""
    from backend.shared.errors import CheckpointError
    from tests.converters.test_safe_checkpoints import _call

    root = tmp_path / "global_step_1" / "actor"
    make_engine().save_checkpoint(str(root), global_step=1)
    model_dir, victim = root / "model" / "dist_ckpt", tmp_path / "pwned"
    if damage == "flipped byte":
        data = sorted(model_dir.glob("*.distcp"))[0]
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "crafted .metadata":
        payload = _call("torch.distributed.checkpoint.filesystem", "os.mkdir", str(victim))
        (model_dir / ".metadata").write_bytes(payload)
        import json

        from converters.manifest import hash_file

        manifest = json.loads((model_dir / "manifest.json").read_text())
        manifest["files"][".metadata"] = hash_file(model_dir / ".metadata")
        # a manifest that agrees does not make it loadable
        (model_dir / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "no manifest":
        (model_dir / "manifest.json").unlink()
    else:
        from tests.recipes.test_resume import crafted_data_state

        crafted_data_state(root.parent / "data.pt", victim)
    with pytest.raises(CheckpointError) as err:
        make_engine().load_checkpoint(str(root))
    where = root.parent / "data.pt" if damage == "crafted data.pt" else model_dir
    assert "\n" not in str(err.value) and str(where) in str(err.value)
    assert not victim.exists()


def test_the_resume_checkpoint_named_to_the_engine_is_checked_when_it_starts(
    make_engine, tmp_path, monkeypatch
):
    """resume_from (the launcher names the checkpoint verl will resume from): a flipped byte
    is refused when the engine starts, before verl starts its rollout; a sound one is then
    loaded without reading every byte again, unless a file changed after the check. Catches
    an early check that never runs, and a load that trusts a check its files outgrew."""
    from backend.shared.errors import CheckpointError
    from recipes.dapo.engine import weights

    root = tmp_path / "global_step_1" / "actor"
    make_engine().save_checkpoint(str(root), global_step=1)
    checked = []
    real = weights.check_sealed
    monkeypatch.setattr(weights, "check_sealed", lambda *a, **k: (checked.append(a), real(*a, **k)))
    engine = make_engine(resume_from=str(root))
    assert len(checked) == 1  # at initialize
    engine.load_checkpoint(str(root))
    assert len(checked) == 1  # nothing changed since: not read again
    data = sorted((root / "model" / "dist_ckpt").glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="differ from manifest.json"):
        engine.load_checkpoint(str(root))  # changed after the early check: checked again
    with pytest.raises(CheckpointError, match="differ from manifest.json") as err:
        make_engine(resume_from=str(root))
    assert "\n" not in str(err.value) and len(checked) == 3


def test_monitor_guards_the_plans_assumed_ep_skew(make_engine):
    engine = make_engine(monitor={"enable": True, "log_dir": None, "assumed_ep_skew": 1.5})
    guard = engine.routing.monitor.skew_guard
    assert guard.assumed_skew == 1.5 and guard.every_n_steps == 50


BETWEEN_STEPS = ("weight_sync", "offload", "onload", "old_log_prob")
IN_STEP = ("forward_backward", "grad_reduce", "optimizer")


def test_train_batch_times_its_parts_and_the_work_since_the_last_step(make_engine):
    """Two optimizer steps of one trainer step (verl's update_lr_scheduler flag on the last):
    their timing/* come once, summed, with the work before them (offload, onload, old
    log-probs, weight sync) in step_s."""
    engine, data = make_engine(), make_batch(seeds=(0, 1))
    engine.offload()
    engine.onload()
    _on_policy(engine, data)  # the old-log-prob pass
    assert len(dict(engine.get_per_tensor_param()[0])) > 0  # the weight sync
    loss_fn = partial(ppo_loss, config=dapo_actor_config())
    wall, outs = 0.0, []
    with engine.train_mode(disable_auto_offload=True):
        for last in (False, True):
            tu.assign_non_tensor(data, update_lr_scheduler=last)
            start = time.perf_counter()
            outs.append(engine.train_batch(data, loss_function=loss_fn)["metrics"])
            wall += time.perf_counter() - start
    assert not any(k.startswith("timing/") for k in outs[0])
    timing = {k: v[0] for k, v in outs[1].items() if k.startswith("timing/")}
    assert {f"timing/{s}_s" for s in BETWEEN_STEPS + IN_STEP} | {
        "timing/step_s",
        "timing/other_s",
        "timing/comm_share",
    } == timing.keys()
    assert all(timing[f"timing/{s}_s"] > 0 for s in BETWEEN_STEPS + IN_STEP)
    inside = sum(timing[f"timing/{s}_s"] for s in IN_STEP)
    between = sum(timing[f"timing/{s}_s"] for s in BETWEEN_STEPS)
    assert inside == pytest.approx(wall, rel=0.05)  # the parts add up to the measured steps
    assert timing["timing/step_s"] == pytest.approx(wall + between, rel=0.05)
    comm = timing["timing/grad_reduce_s"] + timing["timing/weight_sync_s"]
    assert timing["timing/comm_share"] == pytest.approx(comm / timing["timing/step_s"])
    assert 0 <= timing["timing/comm_share"] <= 1
    with engine.train_mode(disable_auto_offload=True):
        again = engine.train_batch(data, loss_function=loss_fn)["metrics"]
    assert again["timing/old_log_prob_s"] == [0.0]  # the work between steps went with step 1


def test_timing_off_and_dispatch_timing_on(make_engine):
    data = make_batch()
    _on_policy(off := make_engine(timing=False), data)
    loss_fn = partial(ppo_loss, config=dapo_actor_config())
    with off.train_mode():
        assert not any(k.startswith("timing/") for k in off.train_batch(data, loss_fn)["metrics"])
    engine = make_engine(timing_dispatch=True)
    with engine.train_mode():
        metrics = engine.train_batch(data, loss_fn)["metrics"]
    assert metrics["timing/moe_dispatch_s"][0] > 0 and metrics["timing/moe_combine_s"][0] > 0


def test_comm_share_over_30_percent_warns_into_the_routing_report(make_engine, caplog):
    engine = make_engine()
    quiet = {"timing/step_s": 1.0, "timing/grad_reduce_s": 0.3, "timing/comm_share": 0.3}
    engine.metrics.warn_comm_share(quiet)
    assert engine.routing.monitor.report()["warnings"] == []
    loud = {"timing/step_s": 1.0, "timing/grad_reduce_s": 0.45, "timing/comm_share": 0.45}
    engine.metrics.warn_comm_share(loud)
    engine.metrics.warn_comm_share(loud)  # at most one warning every COMM_WARN_EVERY steps
    (warning,) = engine.routing.monitor.report()["warnings"]
    assert warning["kind"] == "comm_share" and warning["comm_share"] == 0.45
    assert "communication takes 45% of the step" in caplog.text
    # one CPU rank: no "keep EP and TP inside a node" (backend.instruments.comm_share.CommLayout)
    assert "one rank, no collective" in warning["text"] and "inside a node" not in warning["text"]


def test_compute_after_an_explicit_offload_without_offload_configured(make_engine):
    """to("cpu") frees the parameter buffers; the next train/eval context brings them back
    (it segfaulted before: verl's context onloads only when offload is configured)."""
    engine, data = make_engine(), make_batch()
    with engine.eval_mode():
        before = engine.infer_batch(data)["model_output"]["log_probs"]
    engine.to("cpu")
    assert engine.optim.is_offloaded()
    with engine.eval_mode():
        after = engine.infer_batch(data)["model_output"]["log_probs"]
    assert not engine.optim.is_offloaded()
    for a, b in zip(after.unbind(), before.unbind(), strict=True):
        assert torch.equal(a, b)


def test_packed_micro_batch_padded_to_a_larger_total_keeps_its_sequences():
    """batches.agree_over's padding of a packed row: the tail pseudo-sequence grows to the new
    total, padding is invalid, outputs read back per sequence unchanged."""
    data = make_batch()
    mb = batches.packed_micro_batch(data, [0, 1, 2], tp=2, device="cpu")
    total = mb.ids_BS.shape[1]
    wider = batches._padded_to(mb, 1, total + 6)
    assert wider.cu_seqlens.tolist() == [
        *mb.cu_seqlens.tolist()[: len(mb.lengths_B) + 1],
        total + 6,
    ]
    assert wider.packed.max_seqlen_q == max(
        int(mb.lengths_B.max()), total + 6 - int(mb.lengths_B.sum())
    )
    assert not wider.valid_BS[0, total:].any() and torch.equal(
        wider.valid_BS[0, :total], mb.valid_BS[0]
    )
    values = torch.arange(total + 6, dtype=torch.float)[None]
    for a, b in zip(
        wider.to_nested(values).unbind(), mb.to_nested(values[:, :total]).unbind(), strict=True
    ):
        assert torch.equal(a, b)
    padded = batches._padded_to(batches.micro_batch(data, [0, 1], 2, "cpu"), 4, 20)
    assert padded.ids_BS.shape == (4, 20) and int(padded.valid_BS.sum()) == 12 + 7
