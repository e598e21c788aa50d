"""A stand-in for verl's trainer that leaves behind what Ray and vLLM leave
(tests/recipes/test_run_leftovers.py), started by the launcher's machinery with the run's environment.

Three holders, each mapping a POSIX shared-memory segment of its own (psm_*, as vLLM's message
queues) that nothing will unlink (it is taken off multiprocessing's resource tracker, as a
killed engine's is never unlinked): one in the trainer's process group; one in a session of its
own (a kill of the launcher's group misses it); one in a session of its own and without the
run's id in its environment (as Ray's dashboard and runtime-env agents: the run's by descent
only, and orphaned once the trainer dies). Each one's resource tracker is one more descendant.
And a vllm_dist_* file in the temp dir, as vLLM's file store leaves it.

argv: the manifest to write (the pids, segments and files), then "hang" (wait to be killed)
or "exit" (SIGKILL the first holder once the reaper has seen it, as an engine that died without
unlinking, then exit 0 leaving the other two running).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

RUN_ID = "MCORE_DAPO_RUN_ID"
SEEN_S = 1.5  # the tests' reaper samples every 0.3 s
HOLDER = """
import time
from multiprocessing import resource_tracker, shared_memory
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(shm._name, "shared_memory")  # nothing will unlink it
shm.buf[0] = 1
print(shm.name, flush=True)
time.sleep(600)
"""


def main(manifest: str, mode: str) -> int:
    without_id = {k: v for k, v in os.environ.items() if k != RUN_ID}
    ways = [{}, {"start_new_session": True}, {"start_new_session": True, "env": without_id}]
    holders = [
        subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, **way)
        for way in ways
    ]
    segments = [f"/dev/shm/{h.stdout.readline().strip()}" for h in holders]
    store = Path(tempfile.gettempdir()) / f"vllm_dist_{uuid.uuid4().hex}"
    store.write_text("file store")
    record = {"pids": [os.getpid(), *(h.pid for h in holders)], "segments": segments,
              "files": [str(store)], "tmp": tempfile.gettempdir()}  # fmt: skip
    Path(manifest + ".tmp").write_text(json.dumps(record))
    os.replace(manifest + ".tmp", manifest)
    if mode == "exit":
        time.sleep(SEEN_S)
        holders[0].kill()
        holders[0].wait()
        return 0
    time.sleep(600)
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
