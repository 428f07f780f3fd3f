#!/usr/bin/env python3
"""Build (or reuse) an isolated virtual environment per vendor stack, and run commands in it.

IPEX and torch-xla each pin their own torch (2.8 and 2.9), which must never be installed
into the system Python (torch 2.13). Their suites therefore run in venvs kept OUTSIDE the
repository, in a cache directory keyed by a short hash of the pinned requirement set::

    ~/.cache/halserve/venvs/ipex-1a2b3c4d/      (HALSERVE_VENV_DIR overrides the parent)
        .halserve-env-ok          JSON marker, written only after a successful build
        .halserve-install.json    which checkout halserve was installed from (editable)

Usage::

    python scripts/isolated_env.py ensure ipex          # build or reuse; prints the venv path last
    python scripts/isolated_env.py run xla -- pytest tests/isolated/xla -q
    python scripts/isolated_env.py path ipex            # the venv path (no build)
    python scripts/isolated_env.py list
    python scripts/isolated_env.py test [ipex] [xla]    # CI's step: build or reuse, run each suite, timed

``test`` is how the isolated suites run (``.ci/run`` runs it after the default suite, which
skips them with HALSERVE_SKIP_ISOLATED=1). A first build downloads about 7 GB per stack
(torch with its CUDA libraries, IPEX or torch-xla; pip prints each file it downloads) and
takes several minutes; a venv that is already built is reused in seconds. It prints each
stack's setup and suite times and ends with a summary table; the exit status is non-zero
when a venv cannot be built or a suite fails or runs no test. HALSERVE_SKIP_ISOLATED=1
skips it (exit 0, saying so).

A venv without the marker (an interrupted build) is deleted and rebuilt. halserve itself
is installed with ``pip install --no-deps -e <this checkout>``; it is reinstalled
whenever the checkout path or its packaging (pyproject.toml, setup.py, package folders)
changes, so the venv always imports THIS checkout's code. pip's own cache
(~/.cache/pip) is shared, so a rebuild re-downloads nothing.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The small dependencies halserve needs at run time (plus pytest to run the suites).
# transformers 5.x needs torch >= 2.6, so the versions below work with torch 2.8 and 2.9.
COMMON = [
    "pluggy>=1.3",
    "pydantic>=2",
    "packaging",
    "transformers==5.23.0",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "numpy",
    "tqdm",
    "psutil",
    "pytest",
]

STACKS: dict[str, dict] = {
    "ipex": {
        "download": "about 7 GB: torch 2.8.0 (+cu128, with its CUDA libraries) and IPEX 2.8.0",
        # IPEX checks torch's major.minor at import: 2.8.x only. PyPI has only the CUDA
        # (+cu128) build of torch 2.8.0; IPEX's CPU kernels run on it all the same.
        "requirements": ["torch==2.8.0", "intel-extension-for-pytorch==2.8.0", *COMMON],
        "check": "import torch, intel_extension_for_pytorch as ipex; print('torch', torch.__version__, 'ipex', ipex.__version__)",
        "env": {},
    },
    "xla": {
        "download": "about 7 GB: torch 2.9.0 (with its CUDA libraries) and torch-xla 2.9.0",
        # torch-xla declares no torch requirement but needs torch 2.9.0 at run time.
        "requirements": ["torch==2.9.0", "torch-xla==2.9.0", *COMMON],
        "check": "import torch, torch_xla; print('torch', torch.__version__, 'torch_xla', torch_xla.__version__, torch_xla.device())",
        "env": {"PJRT_DEVICE": "CPU"},
    },
}

MARKER = ".halserve-env-ok"
INSTALL_STAMP = ".halserve-install.json"


def log(msg: str) -> None:
    print(f"[isolated_env] {msg}", file=sys.stderr, flush=True)


def requirement_hash(stack: str) -> str:
    reqs = STACKS[stack]["requirements"]
    canon = "\n".join(sorted(reqs)) + f"\npython{sys.version_info.major}.{sys.version_info.minor}"
    return hashlib.sha256(canon.encode()).hexdigest()[:8]


def venv_root() -> Path:
    env = os.environ.get("HALSERVE_VENV_DIR")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/halserve/venvs").expanduser()


def venv_path(stack: str) -> Path:
    if stack not in STACKS:
        raise SystemExit(f"unknown stack {stack!r}; known: {', '.join(STACKS)}")
    return venv_root() / f"{stack}-{requirement_hash(stack)}"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list[str], env: dict | None = None, what: str = "") -> None:
    t0 = time.monotonic()
    log(f"$ {' '.join(map(str, cmd))}")
    proc = subprocess.run(cmd, env=env)
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{what or cmd[0]} failed with exit code {proc.returncode} after {dt:.0f}s")
    log(f"{what or 'step'} took {dt:.1f}s")


def venv_env(stack: str, venv: Path, base: dict | None = None) -> dict:
    """The environment a command sees inside the venv."""
    env = dict(os.environ if base is None else base)
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONHOME", None)
    env.pop("PYTHONPATH", None)  # never leak the system interpreter's packages in
    env["PYTHONNOUSERSITE"] = "1"
    for key, value in STACKS[stack]["env"].items():
        env.setdefault(key, value)
    return env


def _install_fingerprint() -> dict:
    """What determines halserve's editable install: the checkout path and its packaging."""
    h = hashlib.sha256()
    for name in ("pyproject.toml", "setup.py"):
        p = REPO / name
        if p.exists():
            h.update(p.read_bytes())
    # setuptools' editable finder maps the package list computed at install time.
    h.update("\n".join(sorted(_find_packages())).encode())
    return {"repo": str(REPO), "packaging": h.hexdigest()[:16]}


def _roots() -> list[str]:
    """setup.py's ROOTS folders, read without running setup.py."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise RuntimeError("setup.py defines no ROOTS mapping")


def _find_packages() -> list[str]:
    out = []
    for root in _roots():
        base = REPO / root
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            if "__init__.py" not in filenames:
                dirnames[:] = []
                continue
            out.append(os.path.relpath(dirpath, REPO))
    return out


@contextlib.contextmanager
def _locked(venv: Path):
    """One builder per venv at a time (two pytest sessions may ensure concurrently)."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    lock_path = venv.parent / f".{venv.name}.lock"
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _install_halserve(stack: str, venv: Path) -> None:
    stamp_path = venv / INSTALL_STAMP
    want = _install_fingerprint()
    if stamp_path.exists():
        try:
            if json.loads(stamp_path.read_text()) == want:
                return
        except ValueError:
            pass
    _run(
        [str(_python(venv)), "-m", "pip", "install", "--no-deps", "--quiet", "-e", str(REPO)],
        env=venv_env(stack, venv),
        what="pip install --no-deps -e <repo> (halserve from this checkout)",
    )
    stamp_path.write_text(json.dumps(want))


def _verify(stack: str, venv: Path) -> None:
    code = (
        STACKS[stack]["check"]
        + "; import halserve, os; p = os.path.dirname(halserve.__file__); print('halserve from', p)"
        + f"; assert os.path.realpath(p) == os.path.realpath({str(REPO / 'core')!r}), p"
    )
    _run([str(_python(venv)), "-c", code], env=venv_env(stack, venv), what=f"import check ({stack})")


def ensure(stack: str) -> Path:
    """Build the stack's venv unless a complete one exists; always (re)point halserve at this checkout."""
    venv = venv_path(stack)
    with _locked(venv):
        t0 = time.monotonic()
        if (venv / MARKER).exists() and _python(venv).exists():
            log(f"reusing {venv}")
        else:
            if venv.exists():
                log(f"{venv} has no {MARKER} (an interrupted build?): deleting and rebuilding")
                shutil.rmtree(venv)
            log(f"building {venv} for {stack}: {' '.join(STACKS[stack]['requirements'])}")
            _run([sys.executable, "-m", "venv", str(venv)], what="python -m venv")
            _run(
                [str(_python(venv)), "-m", "pip", "install", "--progress-bar", "off", *STACKS[stack]["requirements"]],
                env=venv_env(stack, venv),
                what=f"pip install ({stack} stack)",
            )
            _install_halserve(stack, venv)
            _verify(stack, venv)
            size = _du(venv)
            (venv / MARKER).write_text(
                json.dumps(
                    {
                        "stack": stack,
                        "requirements": STACKS[stack]["requirements"],
                        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "build_seconds": round(time.monotonic() - t0, 1),
                        "size_bytes": size,
                    },
                    indent=1,
                )
            )
            log(f"built {venv} in {time.monotonic() - t0:.0f}s ({size / 2**30:.1f} GiB)")
        _install_halserve(stack, venv)
        log(f"ensure {stack}: {time.monotonic() - t0:.1f}s")
    return venv


def _du(path: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for f in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def run(stack: str, cmd: list[str], build: bool = True) -> int:
    venv = ensure(stack) if build else venv_path(stack)
    if not (venv / MARKER).exists():
        raise SystemExit(f"{venv} is not built; run: {sys.argv[0]} ensure {stack}")
    if not cmd:
        raise SystemExit("nothing to run: give a command after --")
    # Resolve the executable inside the venv first (`python`, `pytest`, `halserve`).
    exe = venv / "bin" / cmd[0]
    if exe.exists():
        cmd = [str(exe), *cmd[1:]]
    t0 = time.monotonic()
    rc = subprocess.call(cmd, env=venv_env(stack, venv), cwd=os.getcwd())
    log(f"run {stack}: exit {rc} in {time.monotonic() - t0:.1f}s")
    return rc


def _summary_line(stdout: str) -> str:
    """pytest's closing line ("12 passed, 1 skipped in 30.1s"), or "" when pytest did not finish."""
    lines = [ln.strip("= ").strip() for ln in stdout.splitlines()]
    done = [ln for ln in lines if re.match(r"^(\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)|no tests ran)", ln)]
    return done[-1] if done else ""


def test(stacks: list[str]) -> int:
    """Build or reuse each stack's venv and run its suite there; print times and a summary."""
    if os.environ.get("HALSERVE_SKIP_ISOLATED", "").strip().lower() in ("1", "true", "yes"):
        print("isolated suites: skipped (HALSERVE_SKIP_ISOLATED is set)", flush=True)
        return 0
    rows = []
    for stack in stacks or list(STACKS):
        venv = venv_path(stack)
        built = (venv / MARKER).exists()
        print(f"== {stack}: {'reusing' if built else 'building'} {venv}", flush=True)
        if not built:
            print(f"   downloads {STACKS[stack]['download']} (pip lists each file below)", flush=True)
        t0 = time.monotonic()
        try:
            ensure(stack)
        except RuntimeError as exc:
            setup_s = time.monotonic() - t0
            log(f"ERROR: {exc}")
            rows.append((stack, "build failed", "-", setup_s, 0.0, str(exc)))
            continue
        setup_s = time.monotonic() - t0
        size = json.loads((venv / MARKER).read_text()).get("size_bytes") or 0
        cmd = [str(_python(venv)), "-m", "pytest", f"tests/isolated/{stack}", "-q", "-rs", "-p", "no:cacheprovider",
               "--durations=10"]
        log(f"$ {' '.join(cmd)}")
        t1 = time.monotonic()
        proc = subprocess.run(cmd, env=venv_env(stack, venv), cwd=REPO, stdout=subprocess.PIPE, text=True)
        suite_s = time.monotonic() - t1
        sys.stdout.write(proc.stdout)
        summary = _summary_line(proc.stdout)
        ok = proc.returncode == 0 and re.search(r"\d+ passed", summary) is not None
        rows.append((stack, "reused" if built else "built", f"{size / 2**30:.1f} GiB", setup_s, suite_s,
                     ("" if ok else f"FAILED (exit {proc.returncode}): ") + (summary or "pytest did not finish")))
    print("\nisolated suites:", flush=True)
    print(f"  {'stack':<6} {'venv':<13} {'size':>9} {'setup':>8} {'suite':>8}  result")
    for stack, state, size, setup_s, suite_s, result in rows:
        print(f"  {stack:<6} {state:<13} {size:>9} {setup_s:>7.0f}s {suite_s:>7.0f}s  {result}")
    failed = [r[0] for r in rows if r[1] == "build failed" or r[5].startswith("FAILED")]
    if failed:
        print(f"isolated suites: FAILED ({', '.join(failed)})", flush=True)
        return 1
    print("isolated suites: OK", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("ensure", help="build or reuse the stack's venv")
    p.add_argument("stack", choices=sorted(STACKS))
    p = sub.add_parser("run", help="run a command inside the stack's venv (builds it if needed)")
    p.add_argument("stack", choices=sorted(STACKS))
    p.add_argument("--no-build", action="store_true", help="fail instead of building a missing venv")
    p.add_argument("cmd", nargs="*", help="the command (put it after --)")
    p = sub.add_parser("path", help="print the stack's venv path")
    p.add_argument("stack", choices=sorted(STACKS))
    sub.add_parser("list", help="list stacks, their venvs and whether they are built")
    p = sub.add_parser("test", help="build or reuse each stack's venv and run its suite (timed)")
    p.add_argument("stacks", nargs="*", metavar="STACK", help=f"any of {', '.join(STACKS)} (default: every stack)")
    argv = list(sys.argv[1:] if argv is None else argv)
    tail: list[str] = []
    if "--" in argv:  # everything after -- is the command, verbatim
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)

    if args.action == "ensure":
        try:
            print(ensure(args.stack))
        except RuntimeError as exc:
            log(f"ERROR: {exc}")
            return 1
        return 0
    if args.action == "run":
        cmd = args.cmd + tail
        try:
            return run(args.stack, cmd, build=not args.no_build)
        except RuntimeError as exc:
            log(f"ERROR: {exc}")
            return 1
    if args.action == "test":
        unknown = [x for x in args.stacks if x not in STACKS]
        if unknown:
            parser.error(f"unknown stack {unknown[0]!r}; known: {', '.join(STACKS)}")
        return test(args.stacks)
    if args.action == "path":
        print(venv_path(args.stack))
        return 0
    for stack in STACKS:
        venv = venv_path(stack)
        state = "built" if (venv / MARKER).exists() else ("partial" if venv.exists() else "absent")
        print(f"{stack}\t{state}\t{venv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
