"""The monitor on the tiny megatron-core model (world size 1): masks, recompute, a short run."""

import pytest
import torch

from backend.instruments.router_tap import RouterTap
from backend.model.build import BuildOptions, build_model
from backend.model.forward import forward_logits, token_log_probs
from backend.monitor import ExpertLoadMonitor, load_report, tensorboard_writer
from backend.monitor.cli import main as monitor_cli
from backend.qwen3_moe import load_qwen3_moe_spec
from converters.hf_io import read_state_dict
from converters.sharding import load_hf_into_model
from tests.support.oracles import local_counts

pytestmark = pytest.mark.mcore_compat
BATCH, SEQ = 4, 16  # BATCH even: EP2 ranks are DP peers and need equal shapes


def batch():
    """Right-padded rows, prompt of 4 tokens: the mask keeps response tokens only."""
    ids_BS = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([SEQ, 11, 7, 13])
    positions_S = torch.arange(SEQ)
    response_BS = (positions_S >= 4) & (positions_S < lengths[:, None])
    return ids_BS, response_BS


def tiny_actor(groups, hf_dir, recompute=False):
    spec = load_qwen3_moe_spec(hf_dir)
    model = build_model(spec, groups, BuildOptions(recompute=recompute))
    load_hf_into_model(model, read_state_dict(hf_dir), spec)
    return spec, model


def actor_step(model, ids_BS, mask_BS):
    """Forward + backward of a masked token-mean NLL, the shape of the actor update."""
    logp_BS = token_log_probs(forward_logits(model, ids_BS)[:, :-1], ids_BS[:, 1:])
    loss = -(logp_BS * mask_BS[:, 1:]).sum() / mask_BS[:, 1:].sum()
    loss.backward()
    return loss


def counted(groups, hf_dir, recompute):
    spec, model = tiny_actor(groups, hf_dir, recompute)
    tap = RouterTap(model, groups)
    mon = ExpertLoadMonitor(spec.num_layers, spec.num_experts, groups, top_k=spec.top_k).attach(tap)
    replays = []
    tap.add_listener(lambda call: replays.append(call.layer) if call.recompute else None)
    ids_BS, mask_BS = batch()
    tap.set_token_mask(mask_BS)
    with mon.phase("update"):
        actor_step(model, ids_BS, mask_BS)
    return local_counts(mon)[0], replays, int(mask_BS.sum()), spec


def test_padding_excluded_and_recompute_not_double_counted(world1, tiny_hf_dir):
    plain_LE, plain_replays, valid, spec = counted(world1, tiny_hf_dir, recompute=False)
    recomputed_LE, replays, _, _ = counted(world1, tiny_hf_dir, recompute=True)
    assert plain_replays == [] and sorted(replays) == list(range(spec.num_layers))
    assert plain_LE.sum(-1).tolist() == [spec.top_k * valid] * spec.num_layers
    assert valid < BATCH * SEQ  # padding and prompts were there to exclude
    assert torch.equal(recomputed_LE, plain_LE)


def test_short_run_writes_tensorboard_and_report(world1, tiny_hf_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec, model = tiny_actor(world1, tiny_hf_dir)
    tap = RouterTap(model, world1)
    writer = tensorboard_writer(tmp_path / "tb", world1)
    mon = ExpertLoadMonitor(
        spec.num_layers, spec.num_experts, world1, window_steps=2, writer=writer, top_k=spec.top_k
    ).attach(tap)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids_BS, mask_BS = batch()
    tap.set_token_mask(mask_BS)
    for step in range(4):
        with torch.no_grad(), mon.phase("old_log_prob"):
            forward_logits(model, ids_BS)
        with mon.phase("update"):
            actor_step(model, ids_BS, mask_BS)
        optimizer.step()
        optimizer.zero_grad()
        metrics = mon.step_end(step, aux_losses={"moe/aux_loss": 0.01 * step})
    assert metrics["moe/update/tokens"] == metrics["moe/old_log_prob/tokens"] == mask_BS.sum()
    mon.close()
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert "moe/update/layer_1/max_over_mean" in events.Tags()["scalars"]
    assert len(events.Scalars("moe/update/cv_mean")) == 4
    assert [e.step for e in events.Images("moe/update/heatmap")] == [1, 3]
    path = mon.write_report(tmp_path / "report.json", model="tiny")
    report = load_report(path)
    assert report.meta["steps"] == 4 and len(report.windows("update")) == 2
    assert report.cumulative("update").sum() == 4 * spec.num_layers * spec.top_k * mask_BS.sum()
    assert monitor_cli(["render", str(path), "-o", str(tmp_path / "html")]) == 0
    assert (tmp_path / "html" / "update_heatmap.png").is_file()
