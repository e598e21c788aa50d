"""A run's health after verl returns: the routing report with the launcher's alarms in it.

The engine writes the routing-balance report with each checkpoint
(`global_step_N/actor/moe_report.json`); the launcher's console (recipes.dapo.console.screen) appends
the run-health alarms it raised to `<run>/alarms.jsonl`. `routing_report` puts both in
`<run>/routing_report.json` and renders `<run>/routing_report/index.html`
(backend.monitor.render), on the cluster as in the CPU run.
"""

import json
import re
from pathlib import Path

from recipes.dapo.console.alarm_log import ALARMS


def latest_actor_checkpoint(root: Path) -> Path | None:
    """<root>/global_step_N/actor with the largest N (verl's layout) of the complete ones
    (sealed: recipes.dapo.checkpoints.async_save), or None."""
    from recipes.dapo.checkpoints.files import is_complete

    steps = [
        (int(m.group(1)), p / "actor")
        for p in root.glob("global_step_*")
        if (m := re.fullmatch(r"global_step_(\d+)", p.name))
        and (p / "actor" / "meta.json").is_file()
        and is_complete(p / "actor")
    ]
    return max(steps)[1] if steps else None


def latest_fsdp_checkpoint(root: Path) -> Path | None:
    """verl's FSDP engine's newest checkpoint: <root>/global_step_N/actor of the step verl's
    tracker names (verl writes the tracker after every rank saved, its saves being
    synchronous), or None."""
    from recipes.dapo.checkpoints.files import ACTOR, TRACKER

    tracker = root / TRACKER
    text = tracker.read_text().strip() if tracker.is_file() else ""
    actor = root / f"global_step_{text}" / ACTOR
    return actor if text.isdigit() and actor.is_dir() else None


def read_alarms(path: Path) -> list[dict]:
    """The alarms of <run>/alarms.jsonl (every launch of the run); a torn last line skipped."""
    if not path.is_file():
        return []
    alarms = []
    for line in path.read_text().splitlines():
        try:
            alarms.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return alarms


def routing_report(moe_report: Path, run_dir: Path) -> dict[str, Path]:
    """<run_dir>/routing_report.json (the checkpoint's report + the alarms) and its HTML page;
    {} when the checkpoint has no report (the monitor was off)."""
    if not moe_report.is_file():
        return {}
    from backend.monitor.render import render
    from backend.monitor.report import load_report, save_report, with_warnings

    report = load_report(moe_report)
    merged = with_warnings(report.data, read_alarms(run_dir / ALARMS))
    path = save_report(merged, run_dir / "routing_report.json")
    html = render(load_report(path), run_dir / "routing_report") / "index.html"
    return {"routing_report": path, "routing_html": html}
