#!/usr/bin/env python3
"""Build the container image the test suite and the container benchmark run jobs in, with no registry.

Owns: `localhost/orchestrate-test:<key>`, an image with Debian's python3 and the CPU training stack (this venv's
site-packages: torch, accelerate, transformers, trl, datasets, deepspeed) and WITHOUT orchestrate (the node agent
mounts the node package into the container, as it does on a GPU cluster whose image knows nothing of orchestrate).
It also carries a marker file, /etc/orchestrate-test-image, that exists only inside the image: tests read it through
/proc/<rank pid>/root to prove that a rank ran in the container.

How: a root filesystem of hard links (no copy) holding python3, its standard library, the shared libraries that
python and every extension module of the stack link against (from `ldd`), /bin/sh, a minimal /etc, and the
site-packages under /usr/local/lib/python3.11/dist-packages (where Debian's python looks); then
`tar | podman import`. The key is a hash of what went in (python version, every dist-info name, this file), so a
second call with nothing changed only checks that the image exists (~0.1 s).

    scripts/container_image.py [--runtime podman] [--print-key] [--force]

Prints the image reference on its last line. Needs root for podman here (../shared/TESTBED.md "Containers").
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NAME = "localhost/orchestrate-test"
MARKER = "/etc/orchestrate-test-image"
PYTHON = "/usr/bin/python3.11"  # Debian's; the venv's own interpreter lives under /root/.pyenv
DIST = "usr/local/lib/python3.11/dist-packages"
# Not needed to train in the container (tooling of the test environment, and orchestrate itself).
SKIP = ("__editable__", "orchestrate", "pip", "mypy", "ruff", "hypothesis", "_pytest", "pytest", "importlinter",
        "import_linter", "grimp", "pyspy", "py_spy", "6ec57f84c680d3a3778b__mypyc")


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _skipped(name: str) -> bool:
    return name.startswith(SKIP) or name.lower().startswith(SKIP)


def image_key(sp: Path) -> str:
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(subprocess.run([PYTHON, "--version"], capture_output=True, text=True).stdout.encode())
    for name in sorted(os.listdir(sp)):
        if name.endswith(".dist-info") and not _skipped(name):
            h.update(name.encode() + b"\n")
    return h.hexdigest()[:12]


def _elf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False


def shared_libraries(binaries: list[Path]) -> set[str]:
    """Every library outside the site-packages that `binaries` link against (ldd resolves the closure)."""
    libs: set[str] = set()
    for i in range(0, len(binaries), 200):
        out = subprocess.run(["ldd", *map(str, binaries[i:i + 200])], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split("=>")
            target = (parts[1] if len(parts) > 1 else parts[0]).strip().split(" (")[0].strip()
            if target.startswith("/") and os.path.exists(target):
                libs.add(target)
    return libs


def _link_tree(src: Path, dst: Path) -> None:
    """Hard links of `src` under `dst` (symlinks kept as links)."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        # (__pycache__ kept: the same CPython 3.11 bytecode; without it every rank compiles torch & co. at start)
        dirnames[:] = [d for d in dirnames if not (rel == Path(".") and _skipped(d))]
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            if rel == Path(".") and _skipped(name):
                continue
            s, d = Path(dirpath) / name, dst / rel / name
            if s.is_symlink():
                os.symlink(os.readlink(s), d)
            else:
                try:
                    os.link(s, d)
                except OSError:  # another filesystem
                    shutil.copy2(s, d)


def _place(path: str, root: Path) -> None:
    """`path` (and, for a symlink, what it points to) at the same place under `root`."""
    p = Path(path)
    d = root / p.relative_to("/")
    if d.exists() or d.is_symlink():
        return
    d.parent.mkdir(parents=True, exist_ok=True)
    if p.is_symlink():
        target = os.readlink(p)
        os.symlink(target, d)
        _place(str((p.parent / target).resolve()) if not target.startswith("/") else target, root)
    else:
        try:
            os.link(p, d)
        except OSError:
            shutil.copy2(p, d)


def build_rootfs(root: Path, sp: Path, key: str) -> None:
    for d in ("usr/bin", "usr/lib", "usr/lib64", "etc", "tmp", "root", "proc", "sys", "dev", "run", "var/tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for top in ("bin", "lib", "lib64", "sbin"):  # Debian's merged /usr
        os.symlink(f"usr/{top}", root / top)
    os.chmod(root / "tmp", 0o1777)
    os.chmod(root / "var/tmp", 0o1777)
    _link_tree(Path("/usr/lib/python3.11"), root / "usr/lib/python3.11")
    _link_tree(sp, root / DIST)
    binaries = [Path(PYTHON), Path("/usr/bin/dash")]
    for path in (Path(PYTHON), Path("/usr/bin/dash"), Path("/usr/bin/env")):
        _place(str(path), root)
    os.symlink("python3.11", root / "usr/bin/python3")
    os.symlink("python3.11", root / "usr/bin/python")
    os.symlink("dash", root / "usr/bin/sh")
    for dirpath, _, filenames in os.walk(root / DIST):
        binaries += [Path(dirpath) / n for n in filenames if (".so" in n) and _elf(Path(dirpath) / n)]
    binaries += [Path(dp) / n for dp, _, fs in os.walk("/usr/lib/python3.11/lib-dynload") for n in fs]
    ld = Path("/lib64/ld-linux-x86-64.so.2")
    for lib in sorted(shared_libraries(binaries) | {str(ld), str(ld.resolve())}):
        if not lib.startswith(str(root)):
            _place(lib, root)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (root / "etc/nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
    (root / MARKER.lstrip("/")).write_text(f"orchestrate test image {key}\n")


def exists(runtime: str, ref: str) -> bool:
    return subprocess.run([runtime, "image", "exists", ref], capture_output=True).returncode == 0


def build(runtime: str = "podman", force: bool = False) -> str:
    sp = site_packages()
    key = image_key(sp)
    ref = f"{NAME}:{key}"
    if not force and exists(runtime, ref):
        return ref
    with tempfile.TemporaryDirectory(prefix="orchestrate-rootfs-", dir=str(sp.parent)) as tmp:
        root = Path(tmp) / "rootfs"
        build_rootfs(root, sp, key)
        tar = subprocess.Popen(["tar", "-C", str(root), "-cf", "-", "."], stdout=subprocess.PIPE)
        imp = subprocess.run([runtime, "import", "-", ref],
                             stdin=tar.stdout, capture_output=True, text=True)
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0 or imp.returncode != 0:
            raise SystemExit(f"container_image: import failed: {imp.stderr.strip()[-500:]}")
    check = subprocess.run([runtime, "run", "--rm", "--network", "none", ref, "python3", "-c",
                            "import torch, accelerate, transformers, trl; print(torch.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"container_image: {ref} cannot import the stack: {check.stderr.strip()[-800:]}")
    subprocess.run([runtime, "tag", ref, f"{NAME}:latest"], capture_output=True)
    return ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runtime", default="podman")
    ap.add_argument("--print-key", action="store_true", help="print the image key and exit")
    ap.add_argument("--force", action="store_true", help="build even if the image exists")
    args = ap.parse_args()
    if args.print_key:
        print(image_key(site_packages()))
        return 0
    print(build(args.runtime, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
