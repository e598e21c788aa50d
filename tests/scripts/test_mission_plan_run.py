"""scripts/bench/launches/mission_plan_run.py's memory sampler counts the launch's own process tree:
a grandchild's memory (Ray's workers are the launcher's grandchildren) is in it, another
process on the machine is not (a sampler that read every process would count a second job)."""

import subprocess
import sys
import time

from scripts.bench.launches.mission_plan_run import TreeRss

HOLD = "import time; x = bytearray({mib} << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(4)"


def test_the_sampler_counts_the_launchs_tree_and_nothing_else():
    outsider = subprocess.Popen([sys.executable, "-c", HOLD.format(mib=300)])
    launch = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c "{HOLD.format(mib=120)}"'])
    try:
        time.sleep(0.5)
        rss = TreeRss(launch.pid, every_s=0.2).start()
        time.sleep(2.5)
        rss.stop()
    finally:
        launch.wait()
        outsider.wait()
    held = [mib for title, mibs in rss.per_title().items() for mib in mibs if "bytearray" in title]
    assert len(held) == 1 and 120 <= held[0] < 200  # the grandchild, not the 300 MiB outsider
    assert 120 <= rss.peak_total_mib < 300  # PSS of the tree: the grandchild and bash
