"""The routing page at 128 experts: the hottest experts named by id, the load per EP rank at
ep 2 and 4 (and the run's own), and the page read in headless Chromium at 1300 px."""

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from backend.monitor.history import LoadHistory
from backend.monitor.metrics import ep_degrees, hot_share, hottest_experts, overall_metrics
from backend.monitor.render import render
from backend.monitor.render_experts import ep_rows, hottest_line, hottest_section, layer_names
from backend.monitor.report import build_report, load_report, save_report
from tests.support.routing_run import plan_of, skewed_run

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

CHROMIUM = Path("/usr/bin/chromium")
WIDTH = 1300


def planted(path, layers=4, experts=128, ep=4, top_k=8):
    """Every expert 100 assignments a step, but layer 3's expert 17 1000 (10x) and layer 0's
    expert 5 800; layer 1's expert 40 none."""
    counts_LE = torch.full((layers, experts), 100, dtype=torch.int64)
    counts_LE[3, 17], counts_LE[0, 5], counts_LE[1, 40] = 1000, 800, 0
    history = LoadHistory(("update",), layers, experts, ep, window_steps=2)
    for step in range(1, 3):
        history.add(step, counts_LE[None], {}, trainer_step=step)
    return save_report(build_report(history, plan_of(ep), top_k=top_k, run="planted"), path)


def test_the_hottest_expert_is_named_with_its_share(tmp_path):
    """Bug: the hottest named by the wrong index (a flattened [L*E] argmax read as the expert,
    or layer and expert swapped), or a share over all layers instead of its own layer's."""
    counts_LE = load_report(planted(tmp_path / "p.json")).cumulative("update")
    first, second = hottest_experts(counts_LE, 2, top_k=8)
    share = 1000 / (127 * 100 + 1000)
    assert (first["layer"], first["expert"], first["count"]) == (3, 17, 2000)
    assert first["share"] == pytest.approx(share) and first["x_mean"] == pytest.approx(128 * share)
    assert first["token_share"] == pytest.approx(8 * share)
    assert (second["layer"], second["expert"]) == (0, 5)
    assert (
        hottest_line(first)
        == "L3 e17: 7.3% of assignments, 9.3x the mean, picked by 58.4% of tokens"
    )
    hot, dead = layer_names(counts_LE)[1]
    assert dead == "e40" and hot.startswith("e0 1.0x")  # ties: the lower expert first
    assert layer_names(counts_LE)[3][0].startswith("e17 9.3x, e0 0.9x")
    table = hottest_section(counts_LE, 8, 4, "update")[-1]  # experts above their layer's mean
    named = re.findall(r"<tr><td>\d+</td><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td>", table)
    assert named[:2] == [("3", "17", "0"), ("0", "5", "0")]
    assert not [row for row in named if row[0] == "2"]  # layer 2 is even: none above 1x


@pytest.mark.parametrize("experts, top_k", [(8, 2), (128, 8)])
def test_hot_means_the_same_at_8_and_128_experts(experts, top_k):
    """Bug: a share normalised by 1/E alone (12.5% at 8 experts, 0.8% at 128 for an even load);
    x the mean is 1 when even at both, and an expert every token picks reads 100% of tokens,
    as the routing alarm's hot share does."""
    tokens = 100
    even_LE = torch.full((1, experts), tokens * top_k // experts)
    assert hottest_experts(even_LE, 1, top_k)[0]["x_mean"] == pytest.approx(1.0)
    assert hottest_experts(even_LE, 1, top_k)[0]["token_share"] == pytest.approx(top_k / experts)
    shared_LE = torch.zeros(1, experts, dtype=torch.int64)
    shared_LE[0, 3] = tokens  # every token picks expert 3, its other k-1 picks spread
    shared_LE[0, 4 : 4 + top_k - 1] = tokens
    row = hottest_experts(shared_LE, 1, top_k)[0]
    assert row["expert"] == 3 and row["token_share"] == pytest.approx(1.0)
    assert row["x_mean"] == pytest.approx(experts / top_k)
    assert row["token_share"] == pytest.approx(hot_share(row["x_mean"], experts, top_k))


def test_ep_rank_loads_at_ep2_and_ep4_sum_to_the_layer_and_match_a_hand_count():
    """Bug: experts placed round-robin (e % ep) instead of megatron-core's contiguous blocks,
    a rank's load taken from the wrong layer, or the run's own EP skew computed a second way
    that disagrees with the metrics table (ep_max_over_mean_max) and the skew guard."""
    counts_LE = torch.randint(0, 500, (4, 128), generator=torch.Generator().manual_seed(0))
    counts_LE[2, 96:128] *= 3  # layer 2's last quarter: EP rank 3 at ep 4, rank 1 at ep 2
    rows = {r["ep"]: r for r in ep_rows(counts_LE, 4)}
    assert sorted(rows) == [2, 4]
    for ep, row in rows.items():
        load_LR = row["load_LR"]
        assert load_LR.sum(-1).tolist() == counts_LE.sum(-1).double().tolist()
        block = 128 // ep
        hand = [[counts_LE[i, r * block : (r + 1) * block].sum().item() for r in range(ep)]
                for i in range(4)]  # fmt: skip
        assert load_LR.tolist() == hand
        assert row["worst"] == 2
    assert rows[4]["worst_max_over_mean"] == pytest.approx(
        overall_metrics(counts_LE, 4)["ep_max_over_mean_max"]
    )
    assert ep_degrees(128, 8) == [2, 4, 8] and ep_degrees(8, 1) == [2, 4]
    assert ep_degrees(6, 4) == [2] and ep_degrees(2, 1) == [2]


@pytest.fixture(scope="module")
def page128(tmp_path_factory):
    """The rendered page of a skewed run at the mini model's shape: 4 layers x 128, top-8."""
    tmp = tmp_path_factory.mktemp("page128")
    report = load_report(skewed_run(tmp / "r.json", 4, trainer_steps=2, tokens=128))
    return report, render(report, tmp / "html")


def test_the_page_at_128_experts_names_hot_experts_and_ep_loads(page128):
    """Bug: the page at 128 experts without the hottest experts by id or the EP-rank loads at
    ep 2 and 4 (the heatmap's ticks alone cannot say which of 128 columns is hot)."""
    report, out = page128
    page = (out / "index.html").read_text()
    hot = hottest_experts(report.cumulative("update"), 1, top_k=8)[0]
    assert "update: hottest experts" in page and hottest_line(hot) in page
    assert "update: load per EP rank" in page and 'src="update_ep_load.png"' in page
    assert "<td>2</td><td>64</td><td>all layers</td>" in page
    assert "<td>4 (this run)</td><td>32</td><td>all layers</td>" in page
    assert "<details open><summary>update: per-layer metrics (4 layers)</summary>" in page


def test_a_48_layer_page_folds_its_per_layer_tables(tmp_path):
    """Bug: two 48-row tables unfolded make the full model's page twice as long to scroll."""
    history = LoadHistory(("update",), 48, 16, 2, window_steps=2)
    history.add(1, torch.arange(48 * 16).reshape(1, 48, 16) % 7, {})
    page = render(load_report(save_report(build_report(history, plan_of(2), top_k=2),
                                          tmp_path / "r.json")), tmp_path / "html")  # fmt: skip
    assert (
        "<details><summary>update: per-layer metrics (48 layers)</summary>"
        in (page / "index.html").read_text()
    )


PROBE = """<script>window.addEventListener("load", () => {
  const d = document.documentElement, imgs = [...document.images];
  document.body.dataset.probe = [d.scrollWidth, d.clientWidth,
    imgs.filter(i => i.complete && i.naturalWidth > 0).length, imgs.length].join(" ");
});</script></body>"""


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install chromium)")
def test_the_128_expert_page_fits_1300_px_in_chromium(page128):
    """Bug: something on the page (a plot's fixed width, an unwrapped table) wider than a
    1300 px window, so the page scrolls sideways; or a plot that does not load."""
    _, out = page128
    probe = out / "probe.html"
    probe.write_text((out / "index.html").read_text().replace("</body>", PROBE))
    profile = tempfile.mkdtemp()
    try:
        dom = subprocess.run(
            [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", f"--window-size={WIDTH},1000",
             "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    scroll, client, loaded, images = map(int, re.search(r'data-probe="([\d ]+)"', dom)[1].split())
    assert scroll <= WIDTH and scroll <= client, (scroll, client)
    assert loaded == images == 7, (loaded, images)
