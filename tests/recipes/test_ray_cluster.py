"""The cluster path on one box: a real two-node Ray cluster from what scripts/ray_start_*.sh
run (--device cpu: a head and a second raylet, each with its own port, temp dir and one
declared "GPU"), the launcher's cluster mode on it (`--ray-address`, the tiny DAPO job at
tp1/ep2 with packed sequences, one rank per node), a node lost during an update step and the resume from the last
checkpoint.

Every process started here is stopped here by its pid: the nodes by their --stop and then by
their session (recipes.dapo.cluster.ray_node), the launches by their session. The lost node is
SIGKILLed with its whole session (raylet, its workers and agents) at once. A kill during the
rollout instead: MCORE_KILL_PHASE=rollout (by hand; CI kills the update).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from recipes.dapo.cluster import lost_node, ray_job, ray_node
from recipes.launcher import launch
from recipes.local.cpu_overrides import TOY
from tests.recipes.test_verl_cpu_trainer import (  # as the other launches
    FP32_ROLLOUT,
    SYNC_TOLERANCE,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.trainer_flow,
    pytest.mark.usefixtures("dev_shm_unchanged"),
]
REPO = Path(__file__).resolve().parents[2]
KILL_PHASE = os.environ.get("MCORE_KILL_PHASE", "update")  # or rollout
# from the kill to the launcher's exit, at most: Ray's verdict (5 missed health checks 3 s
# apart, ray_job.RAY_HEALTH) + the watch's poll, grace and SIGTERM wait; plus slack for a
# loaded 2-core machine
BOUND_S = 5 * 3 + lost_node.POLL_S + lost_node.GRACE_S + lost_node.TERM_S + 30
# what scripts/ray_start_{head,worker}.sh run after their bootstrap call (run directly here:
# on a machine whose venv other checkouts share, a bootstrap of this checkout's older set
# would reinstall it under them)
NODE = [sys.executable, "-m", "recipes.dapo.cluster.ray_node"]
PLAN = ["--nodes", "2", "--devices-per-node", "1", "--ep", "2"]
# packed sequences (THD micro-batches) at two ranks in verl's own loop: the actor's old
# log-probs equal the rollout's after every sync (the padded path: the world-1 trainer run).
# One generation batch of 4 samples a prompt per step: node loss and resume do not need
# dynamic sampling's extra batches (the mini trainer run has them), and on 2 cores each
# sample costs verl's agent loop ~50 ms
QUIET = ["trainer.save_freq=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
         FP32_ROLLOUT, "actor_rollout_ref.actor.mcore_ep.packed=true",
         "algorithm.filter_groups.enable=false", "actor_rollout_ref.rollout.n=4"]  # fmt: skip


def free_port() -> int:
    return ray_node.free_port()


class Box:
    """The head and worker raylets of one machine, as the scripts start them; every start kept."""

    def __init__(self, root: Path):
        self.root, self.started, self.address = root, [], None
        self.printed: dict[str, str] = {}  # what each script printed when it started

    def start(self, role: str, *flags: str, device: str = "cpu") -> str:
        args = ["--device", device, "--temp-dir", str(self.root / role), *flags]
        if role == "worker":
            args += ["--address", self.address]
        out = subprocess.run([*NODE, role, *args], cwd=REPO, capture_output=True, text=True,
                             timeout=900)  # fmt: skip
        state = self.root / role / f"mcore_ray_{role}.json"
        if state.is_file():
            self.started.append(json.loads(state.read_text()))
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    def pid(self, role: str) -> int:
        return json.loads((self.root / role / f"mcore_ray_{role}.json").read_text())["pid"]

    def stop(self, role: str) -> str:
        out = subprocess.run([*NODE, role, "--stop", "--temp-dir", str(self.root / role)],
                             cwd=REPO, capture_output=True, text=True, timeout=200)  # fmt: skip
        return out.stdout + out.stderr

    def lose(self, role: str) -> float:
        """SIGKILL to every process of the node's session at once; the time of the kill."""
        procs = ray_node.session_processes(self.pid(role))
        assert any(p.name() == "raylet" for p in procs), [p.name() for p in procs]
        t = time.monotonic()
        for proc in procs:
            try:
                proc.kill()
            except Exception:
                continue
        return t


@pytest.fixture(scope="module")
def box():
    root = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths
    cluster_box = Box(root)
    try:
        head = cluster_box.printed["head"] = cluster_box.start("head", "--port", str(free_port()))
        cluster_box.address = re.search(r"Ray head up: cluster (\S+),", head)[1]
        cluster_box.printed["worker"] = cluster_box.start("worker")
        ray_status_counts(cluster_box.address, GPU=2)
        yield cluster_box
    finally:
        for role in ("worker", "head"):
            cluster_box.stop(role)
        for state in cluster_box.started:  # whatever --stop left, by pid, if still ours
            if ray_node.ours(state) != "other":
                ray_node.stop_session(state["pid"], signal.SIGKILL, grace_s=5)
        shutil.rmtree(root, ignore_errors=True)


def ray_status_counts(address: str, timeout: float = 120.0, **devices: int) -> None:
    """Until `ray status` (what check_ray reads) counts these devices: its totals follow a
    node's registration by a few seconds, after Ray's node table already has it."""
    env = {**os.environ, "RAY_AUTH_MODE": ray_job.ray_auth_mode()}
    cmd = [ray_job.ray_executable(), "status", "--address", address]
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env).stdout
        have = ray_job.ray_devices(out)
        if all(have[kind] == n for kind, n in devices.items()):
            return
        assert time.monotonic() < deadline, f"ray status: {have}, not {devices}: {out[-1500:]}"
        time.sleep(1.0)


@pytest.fixture(scope="module")
def state(box):
    """Ray's own tables of the box (GCS), read as ray.cluster_utils does, in the job's token
    mode; disconnected before the nodes stop."""
    from ray._raylet import Config

    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = ray_job.ray_auth_mode()
    Config.initialize("")  # as Ray does when it turns token mode on in a running process
    tables = lost_node.gcs_state(box.address)
    try:
        yield tables
    finally:
        tables.disconnect()
        if before is None:
            os.environ.pop("RAY_AUTH_MODE")
        else:
            os.environ["RAY_AUTH_MODE"] = before


def alive_nodes(state) -> dict[str, dict]:
    return {row["NodeID"]: row for row in state.node_table() if row["Alive"]}


def running_tasks(address: str) -> list[str]:
    from ray.util.state import list_tasks

    tasks = list_tasks(address=address, filters=[("state", "=", "RUNNING")], timeout=10,
                       raise_on_missing_output=False)  # fmt: skip
    return [t.name for t in tasks]


def start_launch(out: Path, box: Box, name: str, *flags: str, overrides=()) -> subprocess.Popen:
    """The launcher on the box's cluster, its output in <out>.<name>.out / .err."""
    cmd = [sys.executable, "-m", "recipes.launcher.launch", "--device", "cpu", "--ray-address",
           box.address, *PLAN, "--model", "tiny", "--ckpt-dir", str(out), *flags, "--", *QUIET,
           *overrides]  # fmt: skip
    with open(logs(out, name)[0], "w") as stdout, open(logs(out, name)[1], "w") as err:
        return subprocess.Popen(cmd, cwd=REPO, stdout=stdout, stderr=err, start_new_session=True)


def logs(out: Path, name: str) -> tuple[Path, Path]:
    return out.with_suffix(f".{name}.out"), out.with_suffix(f".{name}.err")


def stop_launch(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_for(check, what: str, proc: subprocess.Popen, timeout: float = 900.0):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert proc.poll() is None, f"the launch ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.3)
    return found


def saved_step(out: Path) -> int:
    tracker = out / "checkpoints" / lost_node.TRACKER
    return int(tracker.read_text()) if tracker.is_file() else 0


def ranks_and_env(state) -> dict[str, dict[str, str]]:
    """{node id: environment} of each live actor rank (verl's WorkerDict), found in Ray's
    actor table and read from its process."""
    actors = [a for a in state.actor_table(None).values()
              if a["State"] == "ALIVE" and "WorkerDict" in a["ActorClassName"]]  # fmt: skip
    if len(actors) < 2:
        return {}
    env = {}
    for actor in actors:
        raw = Path(f"/proc/{actor['Pid']}/environ").read_bytes().split(b"\0")
        env[actor["Address"]["NodeID"]] = dict(v.decode().split("=", 1) for v in raw if b"=" in v)
    return env


def dist_tensors(actor: Path) -> dict[str, torch.Tensor]:
    from converters.dist_read import DistReader

    reader = DistReader(actor / "model" / "dist_ckpt")
    shapes = {k: reader.global_shape(k) for k in reader.tensors}
    return {k: reader.region(k, (0,) * len(shape), shape) for k, shape in shapes.items()}


def test_two_raylets_on_one_box_and_what_check_ray_refuses(
    box, state, tmp_path, capsys, monkeypatch
):
    nodes = alive_nodes(state)
    assert len(nodes) == 2 and {row["Resources"]["GPU"] for row in nodes.values()} == {1.0}
    temp_dirs = {lost_node.Node.from_table(row).temp_dir for row in nodes.values()}
    assert temp_dirs == {str(box.root / "head"), str(box.root / "worker")}
    assert f"ray_start_worker.sh --device cpu --address {box.address}" in box.printed["head"]
    assert f"ray_start_worker.sh --stop --temp-dir {box.root / 'worker'}" in box.printed["worker"]
    # check_ray on the cluster's real `ray status` (the launch below passes it: 2 GPUs)
    fails = [
        (["--nodes", "4", "--devices-per-node", "1", "--ep", "2"], box.address,
         f"Ray cluster at {box.address} offers 2 GPU, the plan needs 4"),
        (PLAN, f"127.0.0.1:{free_port()}", "no running Ray cluster at 127.0.0.1:"),
    ]  # fmt: skip
    monkeypatch.setenv("RAY_py_gcs_connect_timeout_s", "5")  # Ray's wait for a GCS (30 s)
    for plan, address, needle in fails:
        code = launch.main(["--device", "cpu", "--ray-address", address, *plan, "--model", "tiny",
                            "--ckpt-dir", str(tmp_path / "refused")])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "refused" / "checkpoints").exists()


def test_lost_node_stops_the_run_and_resume_continues_from_its_checkpoint(box, state, tmp_path):
    out, t0 = tmp_path / "run", time.monotonic()
    train_rows = tagged_data(out / "data")  # what the launcher takes as the toy task's data
    head_id = _head_id(state)
    (worker_id,) = set(alive_nodes(state)) - {head_id}
    # a wider update (4 epochs over the batch) to kill it in: verl's update takes ~1 s here
    widen = ("actor_rollout_ref.actor.ppo_epochs=4",) if KILL_PHASE == "update" else ()
    proc = start_launch(out, box, "killed", "--steps", "3", overrides=widen)
    try:
        env = wait_for(lambda: ranks_and_env(state), "two live actor ranks", proc)
        # the EP group (ranks 0 and 1) spans both nodes; the launch's own job env reached them
        assert set(env) == {head_id, worker_id}
        assert sorted(e["RANK"] for e in env.values()) == ["0", "1"]
        for rank_env in env.values():
            assert rank_env["VERL_FILE_LOGGER_PATH"] == str(out / "metrics/launch_000.jsonl")
            assert rank_env["VERL_PLATFORM"] == "cpu" and str(REPO) in rank_env["PYTHONPATH"]
        phase = "update_actor" if KILL_PHASE == "update" else "generate"
        wait_for(lambda: saved_step(out) == 1 and any(phase in t for t in running_tasks(
            box.address)), f"step 2's {phase} running after step 1's save", proc)  # fmt: skip
        runner, servers = _task_runner_node(state), _nodes_of(state, "vLLMHttpServer")
        killed = box.lose("worker")
        proc.wait(timeout=BOUND_S + 60)
        kill_to_exit = time.monotonic() - killed
    finally:
        stop_launch(proc)
    err = logs(out, "killed")[1].read_text()
    where = "the lost node" if runner == worker_id else "the head"
    print(f"\nlost node during {KILL_PHASE} (verl's TaskRunner on {where}): kill to exit "
          f"{kill_to_exit:.1f} s (launch to exit {time.monotonic() - t0:.0f} s)")  # fmt: skip
    assert proc.returncode != 0 and kill_to_exit < BOUND_S, (proc.returncode, kill_to_exit)
    assert servers == {head_id, worker_id}  # one vLLM engine per actor rank, on its node
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [err.splitlines()[-1]], err[-3000:]
    assert errors[0].startswith(f"error: lost Ray node {worker_id[:12]} (")
    assert f"temp dir {box.root / 'worker'}" in errors[0]
    assert f"last complete checkpoint: {out}/checkpoints/global_step_1:" in errors[0]
    assert errors[0].endswith("then relaunch with --resume")
    assert saved_step(out) == 1
    t1 = time.monotonic()
    _restart_worker_with_the_wrong_device_first(box, out)
    t2 = time.monotonic()
    _resume(box, out, train_rows)
    resumed_s = time.monotonic() - t2
    print(f"wrong node, refusal, right node: {t2 - t1:.0f} s; resume launch {resumed_s:.0f} s")


def _task_runner_node(state) -> str:
    """The node of verl's driver-side actor (TaskRunner): anywhere Ray found a CPU for it."""
    (node,) = _nodes_of(state, "TaskRunner")
    return node


def _nodes_of(state, actor_class: str) -> set[str]:
    """The nodes of the live Ray actors whose class name holds `actor_class`."""
    return {a["Address"]["NodeID"] for a in state.actor_table(None).values()
            if a["State"] == "ALIVE" and actor_class in a["ActorClassName"]}  # fmt: skip


def _head_id(state) -> str:
    return next(
        row["NodeID"] for row in alive_nodes(state).values()
        if "node:__internal_head__" in row["Resources"]
    )  # fmt: skip


def _restart_worker_with_the_wrong_device_first(box: Box, out: Path) -> None:
    """A node restarted as an NPU node: check_ray names it in one line, nothing starts; its
    --stop ends its processes only (the head stays); then the right one."""
    box.start("worker", "--devices", "1", device="npu")
    ray_status_counts(box.address, GPU=1, NPU=1)
    wrong = box.pid("worker")
    refused = subprocess.run(
        [sys.executable, "-m", "recipes.launcher.launch", "--device", "cpu", "--ray-address",
         box.address, *PLAN, "--model", "tiny", "--ckpt-dir", str(out), "--resume"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "offers 1 GPU and 1 NPU, the cpu plan needs 2 GPU" in refused.stderr
    assert "scripts/ray_start_worker.sh --device cpu" in refused.stderr
    assert not (out / "metrics" / "launch_001.jsonl").exists()  # nothing started
    assert "stopped the Ray worker" in box.stop("worker")
    assert ray_node.session_processes(wrong) == []
    assert ray_node.read_state(box.root / "head" / "mcore_ray_head.json")  # still up
    box.start("worker")
    ray_status_counts(box.address, GPU=2)


def _resume(box: Box, out: Path, train_rows: int) -> None:
    """--resume on the restarted node, past a half-written step-2 save (the launcher's one line
    names it and global_step_1, the newest complete one), checked from inside the resumed
    run: the engine's load
    line names global_step_1's step and update and its weights' norm (rank 0's shards, read
    from the files by the converters); step 2 draws the dataloader's next prompts after the
    killed run's position and runs from exactly the loaded weights (no actor update in it:
    trainer.critic_warmup=3, so its save holds them), step 3 trains; then the run's finish as
    in the embedded run. Catches a no-op load (the HF weights' norm, update 0) and a
    dataloader not restored (step 2 draws the epoch's first prompts again)."""
    from recipes.local.run import read_history
    from tests.recipes.test_verl_engine import loaded_line  # the engine's line on a checkpoint load

    ckpt = out / "checkpoints"
    half = ckpt / "global_step_2"  # as a kill while step 2's save was written in the background
    shutil.copytree(ckpt / "global_step_1", half)
    for d in half.glob("actor/*/dist_ckpt"):
        for name in (".metadata", "metadata.json", "manifest.json"):
            (d / name).unlink()
    dump = out / "rollouts"
    proc = start_launch(out, box, "resumed", "--resume", "--steps", "3",
                        overrides=("trainer.critic_warmup=3", f"trainer.rollout_data_dir={dump}"))  # fmt: skip
    try:
        proc.wait(timeout=1200)
    finally:
        stop_launch(proc)
    log = (out / "logs" / "launch_001.log").read_text()  # the console's log of the relaunch
    assert proc.returncode == 0, log[-5000:]
    assert "Resuming from" in log
    assert (
        f"resuming from {ckpt / 'global_step_1'}, the newest complete checkpoint: {half} was not "
        "completely written" in logs(out, "resumed")[0].read_text()
    )
    loaded, step2, step3 = (dist_tensors(ckpt / f"global_step_{n}/actor") for n in (1, 2, 3))
    step, update, norm = loaded_line(log, ckpt / "global_step_1/actor")
    schedule = json.loads((ckpt / "global_step_1/actor/optim/dist_ckpt/schedule.json").read_text())
    assert (step, update) == (1, schedule["updates"]) and update > 0
    assert norm == pytest.approx(rank0_norm(loaded), rel=1e-9)
    drawn, order = sampler_state(ckpt / "global_step_1/data.pt", train_rows)
    drawn_after, _ = sampler_state(ckpt / "global_step_2/data.pt", train_rows)
    positions = sorted(order.index(row) for row in trained_rows(dump / "2.jsonl"))
    batch = TOY["train_batch_size"]
    assert len(positions) == batch and drawn <= positions[0] and positions[-1] < drawn_after, (
        f"step 2 trained the prompts at positions {positions}; the killed run had drawn "
        f"{drawn}, the resumed one {drawn_after}"
    )
    rows = {row["step"]: row for row in read_history(out / "metrics")}
    assert sorted(rows) == [1, 2, 3] and rows[3]["training/global_step"] == 3
    for n in (2, 3):  # the rollout got the loaded, then the updated weights through sync
        assert rows[n]["training/rollout_probs_diff_max"] < SYNC_TOLERANCE, n
    assert loaded.keys() == step2.keys() == step3.keys()
    assert all(torch.equal(loaded[k], step2[k]) for k in loaded)  # bit for bit
    assert not all(torch.equal(step2[k], step3[k]) for k in step2)  # step 3 trained
    summary = json.loads((out / "summary.json").read_text())
    assert summary["export_max_logits_diff"] < 1e-4
    assert (out / "export_hf" / "config.json").is_file() and (out / "reward_curve.png").is_file()
    meta = json.loads((ckpt / "global_step_3/actor/meta.json").read_text())
    assert meta["global_step"] == 3 and meta["plan"]["ep"] == 2


def tagged_data(data_dir: Path) -> int:
    """The toy task's parquet files (recipes.local.task.doubles), each train prompt prefixed by its
    row ("17*3+3="): the rows a step trained on can be read from verl's rollout dump. The
    train row count."""
    import pandas as pd

    from recipes.local.task.doubles import write_data

    train_file = write_data(data_dir)["train"]
    train = pd.read_parquet(train_file)
    train["prompt"] = [
        [{**turn, "content": f"{row}*{turn['content']}"} for turn in prompt]
        for row, prompt in enumerate(train["prompt"])
    ]
    train.to_parquet(train_file)
    return len(train)


def sampler_state(data_pt: Path, rows: int) -> tuple[int, list[int]]:
    """(prompts drawn so far, the epoch's order of rows) of verl's dataloader state
    (torchdata's StatefulDataLoader, RandomSampler: randperm from the saved generator)."""
    state = torch.load(data_pt, weights_only=True)["_sampler_iter_state"]
    generator = torch.Generator().set_state(state["sampler_iter_state"]["generator"])
    return state["samples_yielded"], torch.randperm(rows, generator=generator).tolist()


def trained_rows(dump: Path) -> set[int]:
    """Row indices of the prompts in verl's rollout dump of a step (trainer.rollout_data_dir)."""
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    return {int(re.search(r"(\d+)\*\d\+\d=", row["input"])[1]) for row in lines}


def rank0_norm(tensors: dict[str, torch.Tensor]) -> float:
    """L2 norm (float64) of what rank 0 of the tp1/ep2 plan holds of these global tensors: all
    but the experts, which megatron-core gives EP rank r as a contiguous block ([L, E, ...])."""
    from parallel.models import TINY_QWEN3_MOE

    local = TINY_QWEN3_MOE["num_experts"] // 2
    total = 0.0
    for key, tensor in tensors.items():
        part = tensor[:, :local] if ".mlp.experts." in key else tensor
        total += float(part.double().square().sum())
    return total**0.5
