"""A node lost during a cluster run: the job ends in bounded time, with one line naming the
node and the last complete checkpoint.

Ray's GCS marks a node dead once its raylet misses health checks (ray_job.RAY_HEALTH). verl's
trainer often fails by itself then (a dead rank's worker-group call raises), but it need not:
ranks on the other nodes can wait in a collective until HCCL/NCCL give up (HCCL_EXEC_TIMEOUT is
an hour on A2), a rollout can wait on workers that are gone. So the launcher watches the
cluster's node table while the job runs (NodeWatch): once a node the job started with is dead,
verl has GRACE_S to stop by itself, then the launcher stops it (SIGTERM, SIGKILL after TERM_S).
From the death of a node's processes to the launcher's exit: Ray's detection (~15 s; under a
minute for a host that vanished) + POLL_S + GRACE_S + TERM_S at most.
"""

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from recipes.dapo.checkpoints.files import TRACKER  # verl's, written after each complete save

POLL_S, GRACE_S, TERM_S = 2.0, 30.0, 30.0
LATE_S = 20.0  # Ray's verdict on a node whose processes died: 5 missed checks, 3 s apart


@dataclass(frozen=True)
class Node:
    node_id: str
    ip: str
    devices: str  # what it declared to Ray, e.g. "1 GPU"
    temp_dir: str
    head: bool = False

    @classmethod
    def from_table(cls, row: dict) -> "Node":
        """A row of Ray's node table (ray._private.state.GlobalState.node_table)."""
        held = row.get("Resources", {})
        devices = ", ".join(f"{int(held[k])} {k}" for k in ("GPU", "NPU") if held.get(k))
        socket = Path(row.get("RayletSocketName") or "?/?/?/?")  # <temp>/session_*/sockets/raylet
        head = "node:__internal_head__" in held
        return cls(row["NodeID"], row["NodeManagerAddress"], devices or "no devices",
                   str(socket.parents[2]), head)  # fmt: skip

    def describe(self) -> str:
        role = "head, " if self.head else ""
        return f"{self.node_id[:12]} ({role}{self.ip}, {self.devices}, temp dir {self.temp_dir})"


def gcs_state(address: str | None):
    """Ray's own tables of the cluster at `address` (None: the one Ray finds from here), read
    from its GCS as ray.cluster_utils reads them (GlobalState: node_table, actor_table)."""
    from ray._private.services import canonicalize_bootstrap_address_or_die
    from ray._private.state import GlobalState
    from ray._raylet import GcsClientOptions

    gcs = canonicalize_bootstrap_address_or_die(address)
    state = GlobalState()
    options = GcsClientOptions.create(
        gcs, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False
    )
    state._initialize_global_state(options)
    return state


class NodeWatch:
    """Follows a running job's Ray cluster: the nodes alive when it started, which of them died."""

    def __init__(self, address: str | None, env: dict[str, str]):
        """address: None for the cluster Ray finds from this node; env: the job's."""
        self.address, self.auth_mode = address, env.get("RAY_AUTH_MODE")
        self.nodes: dict[str, Node] = {}
        self.lost: list[tuple[Node, str]] = []  # (node, Ray's reason)
        self.stopped_job = False
        self._done = threading.Event()
        self._state = self._thread = None

    def _connect(self):
        if self.auth_mode:  # the job's (cluster.ray_auth_mode), before ray reads its config
            os.environ["RAY_AUTH_MODE"] = self.auth_mode
        return gcs_state(self.address)

    def follow(self, child) -> None:
        """The nodes alive now; then, in a thread while `child` (the job) runs, stop it once
        one of them died."""
        try:
            self._state = self._connect()
            alive = [row for row in self._state.node_table() if row["Alive"]]  # dead stay listed
            self.nodes = {row["NodeID"]: Node.from_table(row) for row in alive}
        except Exception as err:  # the job runs unwatched rather than not at all
            print(f"warning: not watching the Ray nodes ({err})", file=sys.stderr)
            self._state = None
            return
        self._thread = threading.Thread(target=self._watch, args=(child,), daemon=True)
        self._thread.start()

    def _poll(self) -> bool:
        """Whether a node the job started with is dead (then self.lost names them)."""
        try:
            table = {row["NodeID"]: row for row in self._state.node_table()}
        except Exception:  # the GCS unreachable: the head is gone, and the job with it
            return False
        self.lost = [
            (node, (table[nid].get("DeathReasonMessage") or "dead").rstrip("."))
            for nid, node in self.nodes.items()
            if nid in table and not table[nid]["Alive"]
        ]
        return bool(self.lost)

    def _watch(self, child) -> None:
        while not self._done.wait(POLL_S):
            if self._poll():
                break
        if not self.lost or self._done.wait(GRACE_S):
            return
        self.stopped_job = True
        child.terminate()
        if not self._done.wait(TERM_S):
            child.kill()

    def close(self, failed: bool) -> None:
        """After the job ended. A job that failed by itself may have been quicker than Ray's
        verdict on the node it lost (a rank's peers see its sockets close at once): wait up
        to LATE_S for it."""
        self._done.set()
        if self._thread is None:
            return
        self._thread.join()
        deadline = time.monotonic() + LATE_S
        while failed and not self.lost and time.monotonic() < deadline and not self._poll():
            time.sleep(POLL_S)


def last_complete_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The actor checkpoint `trainer.resume_mode=auto` loads: verl's tracker's step, or the
    newest sealed one below it (recipes.dapo.checkpoints.files.is_sealed)."""
    from recipes.dapo.checkpoints.files import is_sealed

    root = Path(ckpt_dir)
    try:
        step = int((root / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None
    for n in range(step, 0, -1):
        actor = root / f"global_step_{n}" / "actor"
        if is_sealed(actor):
            return actor.parent
    return None


def failure_line(watch: NodeWatch | None, ckpt_dir: str | Path, resume: str) -> str | None:
    """One line for a failed job that lost nodes (None if it lost none)."""
    if watch is None or not watch.lost:
        return None
    nodes = "; ".join(f"{node.describe()}: {reason}" for node, reason in watch.lost)
    stopped = ", so the launcher stopped the job" if watch.stopped_job else ""
    ckpt = last_complete_checkpoint(ckpt_dir)
    saved = f"last complete checkpoint: {ckpt}" if ckpt else "no complete checkpoint yet"
    script = "ray_start_head.sh" if any(n.head for n, _ in watch.lost) else "ray_start_worker.sh"
    return (
        f"error: lost Ray node {nodes}{stopped}; {saved}: restart the node "
        f"(scripts/{script}), then {resume if ckpt else 'launch again'}"
    )
