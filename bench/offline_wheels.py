"""Wheels that let bench/gpu.py and the suite run on an offline GPU machine that has PyTorch but not lbt.

    python bench/offline_wheels.py .whl --python 3.12 --have their-packages.txt
    # then, on that machine, in a copy of this checkout holding .whl/, with the Python that has PyTorch:
    python3 -m pip install -q --no-index --no-deps .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
    python3 bench/gpu.py --all

A GPU machine's image usually brings torch, numpy, matplotlib, tensorboard and pytest, but not Hydra, Optuna or
mnist1d, and cannot reach a package index. This walks lbt[dev]'s requirements as installed here (markers read
for the target Python on Linux x86-64), leaves out torch's and torchvision's own requirements, the lint tools
(`make test` runs them, pytest does not) and every name in --have (that machine's `pip list --format=freeze`,
or its package names, one per line or comma-separated), and downloads the rest as wheels for the target Python,
each at the version this suite passes with. A project published only as a source archive
(antlr4-python3-runtime, Hydra's parser) is built into a wheel here: it is pure Python. `--no-deps` on the
other side, because the walk has already chosen every wheel; the checkout goes in editable, as `make setup`
puts it (the suite's tests run `python -m lbt` from other folders). Prints the wheels' total size last.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Brought by the machine's PyTorch, and lint tools that only `make test` runs (not pytest).
NOT_CARRIED = ("torch", "torchvision", "ruff", "mypy")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def marker_env(python: str) -> dict[str, str]:
    return {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def closure(name: str, extras: tuple[str, ...], env: dict[str, str], seen: dict[str, str | None],
            walked: set[tuple[str, tuple[str, ...]]], stop: frozenset[str] = frozenset()) -> None:
    """Every distribution `name[extras]` needs on the target, with the version installed here (None: not here),
    short of the names in `stop` and what only they need."""
    key = canonicalize_name(name)
    if key in stop or (key, extras) in walked:
        return
    walked.add((key, extras))
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        seen[key] = None
        return
    seen[key] = dist.version
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras)):
            closure(req.name, tuple(sorted(req.extras)), env, seen, walked, stop)


def names_in(path: Path | None) -> set[str]:
    if path is None:
        return set()
    words = re.split(r"[,\s]+", path.read_text())
    return {canonicalize_name(re.split(r"[=<>~!@ ]", w, maxsplit=1)[0]) for w in words if w.strip(" .")}


def carried(python: str, have: set[str]) -> dict[str, str | None]:
    env = marker_env(python)
    theirs: dict[str, str | None] = {}
    for name in ("torch", "torchvision"):
        closure(name, (), env, theirs, set())
    stop = frozenset(set(theirs) | have | {canonicalize_name(n) for n in NOT_CARRIED})
    wanted: dict[str, str | None] = {}
    closure("lbt", ("dev",), env, wanted, set(), stop)
    return {name: version for name, version in sorted(wanted.items()) if name != "lbt"}


def download(name: str, version: str | None, python: str, dest: Path) -> None:
    spec = f"{name}=={version}" if version else name
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    binary = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
              "--implementation", "cp", *platforms, "-d", str(dest), spec]
    if subprocess.run(binary, capture_output=True).returncode == 0:
        return
    # No wheel published: build one from the source archive (pure-Python projects only reach here).
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-binary", name, "-w", str(dest), spec],
                           capture_output=True, text=True)
    if built.returncode != 0:
        sys.exit(f"offline_wheels: no wheel of {spec} for Python {python}: {built.stderr.strip().splitlines()[-1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="folder for the wheels (keep it out of git)")
    parser.add_argument("--python", default="3.12", help="the other machine's Python, MAJOR.MINOR (3.12)")
    parser.add_argument("--have", type=Path, help="file naming the packages that machine already has")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    wanted = carried(args.python, names_in(args.have))
    for name, version in wanted.items():
        download(name, version, args.python, args.dest)
        print(f"{name} {version or '(newest: not installed here)'}", flush=True)
    size = sum(p.stat().st_size for p in args.dest.glob("*.whl"))
    print(f"{len(wanted)} wheels in {args.dest}, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
