"""What a DAPO step moves besides forward and backward, at Qwen3-30B-A3B's size: routes per
batch, the checkpoint per save, one weight sync (parallel.traffic, parallel.weight_sync), the
packed-length ladder's padding (parallel.ladder), and the dry run / planner lines that print
them. Figures are computed from the model's config here, not typed in."""

import re

import pytest

from parallel.models import load_spec
from parallel.params import param_counts
from parallel.plan import ParallelPlan
from parallel.rank_layout import RankLayout
from parallel.weight_sync import DEFAULT_BUCKET_MB, LINKS, stage_items, sync_cost

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

SHIPPED = ParallelPlan(nodes=4, devices_per_node=8, tp=4, ep=8)  # A2 and H100 alike


@pytest.fixture(scope="module")
def spec():
    return load_spec(None)


def test_route_bytes_of_the_seeds_batch(spec):
    """512 samples of 4.9k tokens, 48 layers, top-8: 3.85 GB as int32 (the figure verl's
    int32 routes give), a quarter of it as uint8 (128 experts)."""
    from parallel.traffic import route_bytes, route_id_bytes, route_lines

    assert route_id_bytes(spec.num_experts) == 1
    assert route_bytes(spec, 512, 4900, 4) / 1e9 == pytest.approx(3.853, abs=1e-3)
    line = route_lines(spec, 512, 1536, 4900, pp=2)[0]
    assert "0.96 GB per training batch (512 samples) as uint8 (3.85 GB as int32)" in line
    assert "2.89 GB per generation batch (1536 samples)" in line and "its 1/2" in line


def test_save_size_is_weights_and_twelve_bytes_a_parameter_of_optimizer_state(spec):
    from parallel.traffic import save_size

    size, params = save_size(spec, SHIPPED.world), param_counts(spec).total
    assert size.optimizer_bytes == 12 * params and size.model_bytes == 2 * params
    assert size.optimizer_bytes / 1e9 == pytest.approx(366, abs=1)  # the 366 GB
    assert size.per_rank == pytest.approx(size.total / 32)


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_one_sync_of_the_shipped_plans_is_predicted_under_two_seconds(spec, device):
    links, bucket = LINKS[device], DEFAULT_BUCKET_MB << 20
    cost, per_tensor = (sync_cost(spec, SHIPPED, b, links) for b in (bucket, 0))
    assert cost.seconds <= 2.0 and cost.seconds < per_tensor.seconds
    assert cost.collectives < per_tensor.collectives / 5
    # every rank receives what it lacks: 7/8 of the experts, 3/4 of each TP-split tensor
    items = stage_items(spec, SHIPPED, 0)
    want = sum(i.full_bytes * 7 // 8 for i in items if i.expert)
    want += sum(i.local_bytes * 3 for i in items if i.split == "tp")
    assert cost.received_bytes == per_tensor.received_bytes == want
    layout = RankLayout(SHIPPED)  # TP and EP groups stay inside a node
    assert layout.nodes_spanned("tp") == layout.nodes_spanned("ep") == 1
    assert cost.inter_bytes == 0
    assert f"{cost.seconds:.2f} s at {links.line()}" in cost.lines(links, bucket)[0]


def test_a_sync_across_nodes_counts_its_inter_node_bytes(spec):
    plan = ParallelPlan(nodes=4, devices_per_node=8, tp=4, ep=8, pp=2)
    cost = sync_cost(spec, plan, DEFAULT_BUCKET_MB << 20, LINKS["cuda"])
    assert cost.inter_bytes > 0 and cost.first_sync_extra == cost.buckets * 2 + 2


def test_the_ladder_costs_little_padding_and_bounds_the_shapes():
    from parallel.ladder import dapo_like_lengths, ladder_cost

    lengths = dapo_like_lengths(512)
    assert 4.5e3 < sum(lengths) / len(lengths) < 5.2e3  # near the seed's 4.9k a sample
    cost, off = ladder_cost(512, 16384, 4), ladder_cost(1, 16384, 4)
    assert 0 <= cost.extra < 0.01 and off.extra == 0
    assert cost.shapes < off.shapes and cost.laddered % 512 == 0


def _dry_run(capsys, *argv) -> str:
    from recipes.launcher import launch

    assert launch.main(["--dry-run", *argv]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("device", ["npu", "cuda"])
def test_dry_run_prints_routes_saves_and_the_sync(device, capsys, spec):
    from parallel.traffic import save_size

    out = _dry_run(capsys, "--device", device, "--tp", "4", "--ep", "8")
    assert "traffic besides forward and backward (parallel/):" in out
    assert "0.96 GB per training batch (512 samples) as uint8" in out
    size = save_size(spec, 32)
    assert f"checkpoint save (every 50 steps): {size.total / 1e9:.0f} GB" in out
    seconds = float(re.search(r"weight sync \(512 MiB buckets\).*: ([\d.]+) s at", out)[1])
    assert seconds == pytest.approx(
        sync_cost(spec, SHIPPED, 512 << 20, LINKS[device]).seconds, abs=0.01
    )


def test_the_planner_prints_the_ladder_and_the_sync(capsys):
    from parallel.cli import main

    args = ["--tp", "4", "--ep", "8", "--nodes", "4", "--micro-batch-tokens", "16384"]
    assert main([*args, "--device", "npu"]) == 0
    out = capsys.readouterr().out
    assert "packed-length ladder (mcore_ep.packed_length_step): 512 tokens on npu: +" in out
    assert "weight sync (512 MiB buckets)" in out
    assert main([*args, "--device", "cuda"]) == 0
    assert (
        "packed-length ladder (mcore_ep.packed_length_step): off on cuda" in capsys.readouterr().out
    )
