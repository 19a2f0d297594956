#!/usr/bin/env python3
"""Which torch build this machine gets, and the pip arguments that install it: the one rule `scripts/setup.sh` and
`docker/install.sh` (both images) share (docs/deploy.md, "Which torch build"). Standard library only: it runs
before torch is installed, with the interpreter of the environment to install into.

    python scripts/torch_build.py [--cpu | --driver VERSION [--compute-cap X.Y]] [--index-url URL]
                                  [--torch VERSION] [--find-links DIR]...

Prints the arguments for ``pip install``, one per line, on stdout and one line on stderr saying what it chose and
why. Exit 2 with a one-line reason when no build of this torch runs on the machine's driver.

The rule, in order:

1. ``--index-url`` or ``$TORCH_INDEX_URL``: that index, as the user asked.
2. The build: ``--cpu``; else ``--driver`` (an image built for hosts with that driver); else ``nvidia-smi``. No
   NVIDIA GPU (no ``nvidia-smi``, or it fails) -> the CPU build. Driver >= 580 -> CUDA 13.0 (on Linux x86_64 that
   is PyPI's own torch wheel). 525.60.13 <= driver < 580, or a GPU older than Turing (compute capability < 7.5,
   which the CUDA 13.0 build dropped) -> CUDA 12.6. Older drivers, and Blackwell GPUs (>= 10.0, absent from the
   12.6 build) on drivers below 580: refused.
3. The source: when pip already finds exactly that build in a local wheel folder it is configured with
   (``--find-links``, ``$PIP_FIND_LINKS``, pip.conf), it is installed from there without naming PyTorch's index,
   so a machine without internet (or where download.pytorch.org is unreachable: CI) installs in the same time as
   before and no unreachable index adds retries. Found by a ``pip install --dry-run --no-index`` of the exact
   version, no network, well under a second.

Every requirement names the build exactly (``torch==2.13.0+cpu``, ``torch==2.13.0+cu126``; PyPI's CUDA 13.0 wheel,
which has no ``+`` label, as ``torch===2.13.0``, PEP 440 arbitrary equality), so a wheel of another build lying in
a find-links folder (the CPU wheel CI leaves in docker/wheels/) can never stand in for the chosen one.

Sources: the CUDA builds of torch 2.13 (12.6 and 13.0; 13.2 experimental; no 12.8 since 2.12) and the compute
capabilities each covers: pytorch/pytorch RELEASE.md, "Release Compatibility Matrix" and "PyTorch CUDA Support
Matrix". Driver minimums (Linux x86_64): NVIDIA CUDA Toolkit release notes, "CUDA Toolkit and Corresponding
Driver Versions" (12.6 Update 3: >= 560.35.05; 13.0 Update 2: >= 580.95.05) and NVIDIA's "Minor Version
Compatibility" (any CUDA 12.x build: >= 525.60.13, a limited feature set below the toolkit's own driver; 13.x:
>= 580).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass, field

TORCH_VERSION = "2.13.0"
PYTORCH_INDEX = "https://download.pytorch.org/whl"
CUDA13_DRIVER = (580,)             # CUDA 13.x, minor version compatibility (the 13.0 toolkit's own: 580.65.06)
CUDA12_DRIVER = (525, 60, 13)      # CUDA 12.x, minor version compatibility
CU126_FULL_DRIVER = (560, 35, 5)   # CUDA 12.6 Update 3, the toolkit's own driver (the full feature set)
TURING, BLACKWELL = (7, 5), (10, 0)


class Refused(Exception):
    """No build of this torch runs here; the message says why and what to do."""


@dataclass
class Choice:
    """The build (``cpu``, ``cu126``, ``cu130``, or the label of a user's index) and how pip gets it."""
    build: str
    requirement: str               # e.g. torch==2.13.0+cpu
    index_url: str | None          # None: pip's configured sources (PyPI, local folders)
    reason: str
    notes: list[str] = field(default_factory=list)

    def pip_args(self) -> list[str]:
        return (["--index-url", self.index_url] if self.index_url else []) + [self.requirement]

    def line(self) -> str:
        src = self.index_url or "pip's configured sources"
        return f"torch: {self.requirement} from {src}: {'; '.join([self.reason] + self.notes)}"


def version_tuple(text: str) -> tuple[int, ...]:
    """``'550.54.15'`` -> ``(550, 54, 15)``. Raises ValueError on anything else."""
    if not re.fullmatch(r"\d+(\.\d+)*", text.strip()):
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(p) for p in text.strip().split("."))


def parse_nvidia_smi(text: str) -> tuple[str, list[tuple[int, int]]]:
    """Output of ``nvidia-smi --query-gpu=driver_version,compute_cap --format=csv,noheader`` (one GPU a line; the
    compute capability may be absent on old drivers) -> (driver version, compute capabilities)."""
    drivers, caps = [], []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if not parts[0]:
            continue
        version_tuple(parts[0])
        drivers.append(parts[0])
        if len(parts) > 1 and re.fullmatch(r"\d+\.\d+", parts[1]):
            caps.append(tuple(int(x) for x in parts[1].split(".")))
    if not drivers:
        raise ValueError(f"no driver version in nvidia-smi's output: {text!r}")
    return drivers[0], caps


def probe_nvidia_smi() -> tuple[str | None, str]:
    """(nvidia-smi's output, or None when there is no working NVIDIA driver; what was seen)."""
    for query in ("driver_version,compute_cap", "driver_version"):
        try:
            r = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30)
        except FileNotFoundError:
            return None, "no nvidia-smi on PATH"
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"nvidia-smi failed ({exc})"
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout, "nvidia-smi"
    msg = (r.stderr or r.stdout).strip().splitlines()
    return None, f"nvidia-smi failed ({msg[0] if msg else f'exit {r.returncode}'})"


def _cuda13(torch: str, machine: str, sysname: str) -> tuple[str, str | None]:
    """PyPI's wheel is the CUDA 13.0 build on Linux x86_64 (no ``+`` label); elsewhere PyTorch's cu130 index."""
    if sysname == "Linux" and machine in ("x86_64", "AMD64"):
        return f"torch==={torch}", None
    return f"torch=={torch}+cu130", f"{PYTORCH_INDEX}/cu130"


def choose_build(*, driver: str | None, caps: list[tuple[int, int]], seen: str, torch: str = TORCH_VERSION,
                 sysname: str | None = None, machine: str | None = None) -> Choice:
    """The build for a machine with NVIDIA driver ``driver`` (None: no usable NVIDIA GPU) and GPUs of compute
    capabilities ``caps`` (may be empty: unknown). Raises :class:`Refused`."""
    sysname = sysname or platform.system()
    machine = machine or platform.machine()
    if driver is None:
        if sysname == "Darwin":  # PyPI's macOS wheel is the CPU (+ MPS) build
            return Choice("cpu", f"torch=={torch}", None, f"no NVIDIA GPU ({seen}): PyPI's macOS wheel")
        return Choice("cpu", f"torch=={torch}+cpu", f"{PYTORCH_INDEX}/cpu", f"no NVIDIA GPU ({seen}): the CPU build")
    d = version_tuple(driver)
    old_gpu = bool(caps) and min(caps) < TURING
    blackwell = bool(caps) and max(caps) >= BLACKWELL
    where = f"NVIDIA driver {driver}" + (f", compute capability {'/'.join('%d.%d' % c for c in sorted(set(caps)))}"
                                         if caps else "") + f" ({seen})"
    cu126 = (f"torch=={torch}+cu126", f"{PYTORCH_INDEX}/cu126")
    if d >= CUDA13_DRIVER and not old_gpu:
        req, index = _cuda13(torch, machine, sysname)
        return Choice("cu130", req, index, f"{where}: the CUDA 13.0 build (needs driver >= 580)")
    if d >= CUDA13_DRIVER:
        return Choice("cu126", *cu126, f"{where}: the CUDA 12.6 build (the CUDA 13.0 build has no kernels below "
                                       "compute capability 7.5)")
    if blackwell:
        raise Refused(f"{where}: torch {torch} has no build for a Blackwell GPU on a driver below 580 (its CUDA 12.6 "
                      "build lacks Blackwell kernels; CUDA 13.0 needs >= 580): upgrade the NVIDIA driver to >= 580")
    if d < CUDA12_DRIVER:
        raise Refused(f"{where}: older than any CUDA build of torch {torch} runs on (CUDA 12.6: >= 525.60.13, "
                      "CUDA 13.0: >= 580): upgrade the NVIDIA driver, or choose a build yourself, e.g. "
                      f"TORCH_INDEX_URL={PYTORCH_INDEX}/cpu")
    choice = Choice("cu126", *cu126, f"{where}: the CUDA 12.6 build (CUDA 13.0 needs driver >= 580)")
    if d < CU126_FULL_DRIVER:
        choice.notes.append("below 560.35.05 it runs under CUDA minor version compatibility (NVIDIA: a limited "
                            "feature set); a driver >= 580 gets the CUDA 13.0 build")
    return choice


def user_index(url: str, torch: str = TORCH_VERSION) -> Choice:
    """``$TORCH_INDEX_URL``: the index as given. A PyTorch-style last path part (``cpu``, ``cu126``, ``rocm7.2``,
    ``xpu``) pins that build exactly, so a local wheel of another build cannot stand in for it."""
    label = url.rstrip("/").rsplit("/", 1)[-1]
    exact = re.fullmatch(r"cpu|cu\d+|rocm[\d.]+|xpu", label)
    req = f"torch=={torch}+{label}" if exact else f"torch=={torch}"
    return Choice(label if exact else "index", req, url, "TORCH_INDEX_URL / --index-url given")


def local_wheel(requirement: str, find_links: list[str], pip: list[str] | None = None) -> str | None:
    """The URL of the wheel pip would install for ``requirement`` from local sources alone (``--no-index``: its
    find-links folders, none of its indexes), or None. No network: ``--retries 0`` and a short timeout guard a
    find-links URL someone configured."""
    pip = pip or [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = pip + ["install", "--dry-run", "--no-index", "--no-deps", "--ignore-installed", "--quiet",
                     "--disable-pip-version-check", "--retries", "0", "--timeout", "5", "--report", report]
        for d in find_links:
            cmd += ["--find-links", d]
        try:
            r = subprocess.run(cmd + [requirement], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                return None
            with open(report) as f:
                items = json.load(f).get("install", [])
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None
    urls = [i.get("download_info", {}).get("url", "") for i in items]
    return urls[0] if len(urls) == 1 and urls[0].startswith("file:") else None


def decide(args: argparse.Namespace, env: dict[str, str], *, smi: str | None = None, seen: str = "nvidia-smi",
           local=local_wheel) -> Choice:
    """The whole rule (the module docstring) for parsed ``args``; ``smi``: nvidia-smi's output (None: none)."""
    index = args.index_url or env.get("TORCH_INDEX_URL") or None
    if index:
        return user_index(index, args.torch)
    if args.cpu:
        choice = choose_build(driver=None, caps=[], seen="--cpu", torch=args.torch)
    elif args.driver:
        caps = [tuple(int(x) for x in args.compute_cap.split("."))] if args.compute_cap else []
        choice = choose_build(driver=args.driver, caps=caps, seen="--driver", torch=args.torch)
    elif smi is not None:
        driver, caps = parse_nvidia_smi(smi)
        choice = choose_build(driver=driver, caps=caps, seen=seen, torch=args.torch)
    else:
        choice = choose_build(driver=None, caps=[], seen=seen, torch=args.torch)
    found = local(choice.requirement, args.find_links)
    if found:
        path = urllib.parse.unquote(urllib.parse.urlsplit(found).path)
        choice.notes.append(f"{path} (a local wheel folder pip is configured with): no download")
        choice.index_url = None
    return choice


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--cpu", action="store_true", help="the CPU build, whatever the GPU")
    g.add_argument("--driver", help="choose for this NVIDIA driver version instead of asking nvidia-smi")
    p.add_argument("--compute-cap", help="with --driver: the GPU's compute capability, e.g. 7.0")
    p.add_argument("--index-url", help="install from this index (default $TORCH_INDEX_URL; else the rule)")
    p.add_argument("--torch", default=TORCH_VERSION, help=f"torch version (default {TORCH_VERSION})")
    p.add_argument("--find-links", action="append", default=[], help="a local wheel folder to look in first")
    return p


def main(argv: list[str] | None = None, env: dict[str, str] | None = None) -> int:
    args = parser().parse_args(argv)
    env = dict(os.environ) if env is None else env
    smi, seen = (None, "") if (args.cpu or args.driver or args.index_url or env.get("TORCH_INDEX_URL")) \
        else probe_nvidia_smi()
    try:
        choice = decide(args, env, smi=smi, seen=seen)
    except (Refused, ValueError) as exc:
        print(f"torch: refused: {exc}", file=sys.stderr)
        return 2
    print(choice.line(), file=sys.stderr)
    print("\n".join(choice.pip_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
