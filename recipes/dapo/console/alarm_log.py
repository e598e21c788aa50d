"""Where the launcher's console keeps the run-health alarms it raised: `<run>/alarms.jsonl`,
appended by every launch of the run (recipes.dapo.console.health_report reads it back into the routing
report), and tensorboard (`alarms/<kind>`) when the run has a directory for it.
"""

import json
from dataclasses import dataclass
from pathlib import Path

ALARMS = "alarms.jsonl"  # in the run directory, appended by every launch


@dataclass
class AlarmLog:
    """Where alarms are kept: `<run>/alarms.jsonl` (appended) and tensorboard, when given."""

    path: Path
    tensorboard_dir: str | None = None
    _writer: object = None

    def write(self, alarm) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(alarm.as_dict()) + "\n")
        if self.tensorboard_dir:
            if self._writer is None:  # imported only once an alarm fires
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(self.tensorboard_dir)
            self._writer.add_scalar(f"alarms/{alarm.kind}", alarm.values.get("measured", 1.0),
                                    alarm.step)  # fmt: skip
            self._writer.add_text("alarms", alarm.line(), alarm.step)
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
