"""The run's reaper: ends what a run started and removes what it left, after a clean finish,
between two attempts and after the launcher was killed (docs/exit_codes.md, "What a run leaves
behind"). Standard library only: it starts in a fraction of a second.

recipes.dapo.cluster.run_scope starts it in a session of its own (a kill of the launcher's process
group does not reach it) with the run's id, the launcher's pid and start time and the run's
temp dir. What it takes for the run's, each provably:
- a process whose environment carries MCORE_DAPO_RUN_ID=<id> (the launcher puts it in the
  training child's; Ray's GCS, raylet and workers, vLLM's engines and their helpers inherit
  it), or a descendant of one (Ray's raylet starts its dashboard and runtime-env agents with an
  environment of their own), recorded every sample_s while its parent lived, so a process the
  launcher's death orphaned stays known. A pid is held with its start time and signalled
  through a pidfd after checking it: a reused pid is never taken for the run's.
- a POSIX shared-memory file in /dev/shm (vLLM's message queues, psm_*, 160 + 240 MB per
  engine, which its engines leave even on a clean exit; verl's weight buckets; semaphores)
  seen mapped by a run process (/proc/<pid>/maps, every sample_s and once more before the
  processes are ended); removed only while it is the same file (inode) and no live process maps
  it. Its creation time or owner would not tell it from another run's on the same machine, nor
  from one some other program leaked.
- a leaked one of the kinds the run's libraries make (LEAKED: multiprocessing's psm_* segments
  and sem.mp-* semaphores) that no process maps any longer, created since the run started:
  what a process made and died with between two samples (a killed vLLM engine, a
  multiprocessing helper whose resource tracker went with it). Another run's, still in use,
  is mapped, and so kept (`remove_unowned`; ray_node's --stop does the same for a node).
- a temp file: everything in the run's own temp dir, the training child's TMPDIR (vLLM's
  vllm_dist_* file stores and ZMQ sockets, verl's checkpoint locks, multiprocessing's pymp-*).
Protocol: on stdin "reap" (end and remove now, then keep watching) or "exit" (the run is over);
EOF on stdin or the launcher's pid gone is the launcher's death. Each reap answers one line on
stdout and appends it to the log file. Ending: SIGTERM, SIGKILL after GRACE_S to what is left,
new children of the run included: within 10 s of the launcher's death.
"""

import os
import select
import shutil
import signal
import sys
import time
from pathlib import Path

RUN_ID = "MCORE_DAPO_RUN_ID"
POLL_S = 0.5  # how often the launcher's life is checked
# how often the run's processes and their mappings are recorded: ~75 ms of CPU for 40 torch
# processes' maps; vLLM's segments live as long as their engine, and the processes' maps are
# read once more before they are ended
SAMPLE_S = 5.0
GRACE_S = 3.0  # after SIGTERM, before SIGKILL
GIVE_UP_S = 6.0  # after SIGTERM: a process left then (uninterruptible) is reported, not waited on
SHM = b"/dev/shm/"
SHM_DIR = Path("/dev/shm")
LEAKED = ("psm_", "sem.mp-")  # multiprocessing's shared memory and named semaphores


def process_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time in clock ticks, state letter) of every process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(name)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def carries(pid: int, mark: bytes) -> bool:
    """Whether the process's environment holds the entry `mark` (NAME=value)."""
    try:
        return mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def mapped_shm(pid: int) -> dict[str, int]:
    """The /dev/shm files a process maps -> their inode (from /proc/<pid>/maps)."""
    try:
        text = Path(f"/proc/{pid}/maps").read_bytes()
    except OSError:
        return {}
    if SHM not in text:
        return {}
    found = {}
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(SHM) and not parts[5].endswith(b"(deleted)"):
            found[os.fsdecode(parts[5])] = int(parts[4])
    return found


class Run:
    """The processes and shared-memory files of one run (module doc)."""

    def __init__(self, run_id: str, spared: set[int]):
        self.mark = f"{RUN_ID}={run_id}".encode()
        self.spared = spared  # the reaper and the launcher: never the run's
        self.known: dict[int, int] = {}  # pid -> start time
        self.segments: dict[str, int] = {}  # path -> inode
        self.started = time.time()  # what the run may have leaked is newer

    def scan(self) -> dict[int, tuple[int, int, str]]:
        """Record the run's processes now (those known and still the same, those carrying the
        id, their descendants); the process table read."""
        table = process_table()
        self.known = {p: t for p, t in self.known.items() if p in table and table[p][1] == t}
        for pid, (_, start, _) in table.items():
            if pid not in self.known and pid not in self.spared and carries(pid, self.mark):
                self.known[pid] = start
        grew = True
        while grew:
            grew = False
            for pid, (parent, start, _) in table.items():
                if parent in self.known and pid not in self.known and pid not in self.spared:
                    self.known[pid], grew = start, True
        return table

    def sample(self) -> None:
        """Record the /dev/shm files the run's processes map now."""
        for pid in self.known:
            self.segments.update(mapped_shm(pid))

    def live(self, table) -> list[int]:
        return [p for p in self.known if table[p][2] not in "ZX"]  # a zombie is over

    def end(self) -> tuple[int, int, int]:
        """SIGTERM every run process, SIGKILL what is left after GRACE_S (children started
        meanwhile too); (ended, of them killed, left alive)."""
        signalled: dict[int, set] = {signal.SIGTERM: set(), signal.SIGKILL: set()}
        start = time.monotonic()
        while True:
            table = self.scan()
            if not signalled[signal.SIGTERM]:
                self.sample()  # the last look at what they map, before any is ended
            live = self.live(table)
            waited = time.monotonic() - start
            if not live or waited > GIVE_UP_S:
                break
            sig = signal.SIGKILL if waited > GRACE_S else signal.SIGTERM
            for pid in live:
                if (pid, self.known[pid]) not in signalled[sig]:
                    _signal(pid, self.known[pid], sig)
                    signalled[sig].add((pid, self.known[pid]))
            time.sleep(0.1)
        return (
            len(signalled[signal.SIGTERM] | signalled[signal.SIGKILL]),
            len(signalled[signal.SIGKILL]),
            len(live),
        )

    def remove_segments(self) -> tuple[int, int]:
        """Remove the recorded files that are still the same and that no live process maps;
        (files, bytes) removed."""
        if not self.segments:
            return 0, 0
        mapped = in_use()
        count = size = 0
        for path, inode in list(self.segments.items()):
            try:
                st = os.stat(path)
                if st.st_ino != inode:  # gone, and the name taken by a new file
                    del self.segments[path]
                elif path not in mapped:
                    os.unlink(path)
                    del self.segments[path]
                    count, size = count + 1, size + st.st_size
            except FileNotFoundError:  # its owner removed it
                del self.segments[path]
        return count, size


def in_use() -> set[str]:
    """Every /dev/shm path a live process maps now."""
    found: set[str] = set()
    for pid in process_table():
        found.update(mapped_shm(pid))
    return found


def remove_unowned(since: float, shm: Path = SHM_DIR) -> tuple[int, int]:
    """Remove the LEAKED files of `shm` created at or after `since` (time.time()) that no live
    process maps; (files, bytes) removed."""
    candidates = []
    for path in shm.glob("*"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if path.name.startswith(LEAKED) and st.st_ctime >= since:
            candidates.append((path, st))
    if not candidates:
        return 0, 0
    mapped = in_use()
    count = size = 0
    for path, st in candidates:
        if str(path) in mapped:
            continue
        try:
            if path.stat().st_ino == st.st_ino:
                path.unlink()
                count, size = count + 1, size + st.st_size
        except FileNotFoundError:
            continue
    return count, size


def _signal(pid: int, start: int, sig: int) -> None:
    """`sig` to the process `pid` if it is still the one that started at `start` (a pidfd
    pins it while its start time is checked)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19] == str(start):
            signal.pidfd_send_signal(fd, sig)
    except (OSError, IndexError):
        pass
    finally:
        os.close(fd)


def reap(run: Run, tmp: Path) -> str:
    """End the run's processes, remove its shared memory and its temp dir's contents; a line
    saying what was done."""
    ended, killed, left = run.end()
    count, size = run.remove_segments()
    leaked, leaked_size = remove_unowned(run.started)
    count, size = count + leaked, size + leaked_size
    files = sum(1 for _ in tmp.rglob("*")) if tmp.is_dir() else 0
    shutil.rmtree(tmp, ignore_errors=True)
    line = (
        f"ended {ended} processes ({killed} by SIGKILL), removed {count} shared-memory "
        f"files ({size / 2**20:.0f} MiB) and {files} temp files"
    )
    return line + (f"; {left} processes would not end" if left else "")


def _alive(pid: int, start: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19] == str(start)
    except (OSError, IndexError):
        return False


def _say(text: str, log: Path, run_id: str) -> None:
    """`text` to the log file, then to the launcher (which may be gone)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    try:
        with log.open("a") as f:
            f.write(f"{stamp} run {run_id}: {text}\n")
    except OSError:
        pass
    try:
        print(text, flush=True)
    except OSError:  # BrokenPipeError: the launcher is gone; later flushes must not raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)


def main(argv: list[str]) -> int:
    """argv: run id, launcher pid, launcher start time, temp dir, log file, sample seconds."""
    run_id, launcher, launcher_start, tmp, log, sample_s = argv
    launcher, tmp, log = int(launcher), Path(tmp), Path(log)
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's signals are the launcher's
        signal.signal(sig, signal.SIG_IGN)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # killed: clean up first
    run = Run(run_id, {os.getpid(), launcher})
    _say(f"ready: watching launcher pid {launcher}, temp dir {tmp}", log, run_id)
    pending, next_sample = b"", 0.0
    while True:
        command = None
        if not stop and select.select([0], [], [], POLL_S)[0]:
            chunk = os.read(0, 4096)
            pending += chunk or b"exit\n"  # EOF: the launcher died
        if b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            command = line.decode().strip() or None
        if stop or not _alive(launcher, int(launcher_start)):
            command = "exit"
        if command is None:
            if time.monotonic() >= next_sample:
                run.scan()
                run.sample()
                next_sample = time.monotonic() + float(sample_s)
            continue
        _say(f"reaped: {reap(run, tmp)}", log, run_id)
        if command != "reap":
            return 0
        tmp.mkdir(mode=0o700, exist_ok=True)  # the next attempt's


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
