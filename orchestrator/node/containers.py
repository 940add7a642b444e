"""A node's container runtime, from the node's side (standard library only: it runs on hosts that lack orchestrate).

Owns what the node agent and its pre-flight ask of the runtime on this host (the command lines themselves are built
by the one builder, orchestrator.core.container): is the runtime there, is the image there (pulled when it is a
registry reference that is not), do the mounts' host paths exist, which training stack the image carries (run in the
image itself: the versions every host must agree on), the image's digest, and removing a node's container by name
(podman / docker, whose containers outlive their client). Every call has a deadline; nothing here raises on a
runtime's failure: it returns the problem as a sentence that names the host and the image.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from typing import Any

from orchestrator.core.container import ContainerPlan, container_name, list_argv, remove_argv, stop_argv

STACK = ("torch", "accelerate", "transformers", "trl", "deepspeed")
# Run in the image by its python: the stack's versions as one JSON line (a package that is not there: null).
VERSIONS_SCRIPT = (
    "import json, sys\n"
    "from importlib import metadata\n"
    "out = {'python': sys.version.split()[0]}\n"
    "for name in sys.argv[1:]:\n"
    "    try:\n"
    "        out[name] = metadata.version(name)\n"
    "    except Exception:\n"
    "        out[name] = None\n"
    "print('ORCHESTRATE_VERSIONS ' + json.dumps(out))\n")


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
        return r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]} {argv[1] if len(argv) > 1 else ''} did not answer within {timeout:.0f} s"
    except OSError as e:
        return 127, "", str(e)


def _last(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _is_file_image(image: str) -> bool:
    return image.startswith(("/", "~", "./")) or image.endswith((".sqsh", ".squashfs", ".sif"))


def image_facts(cp: ContainerPlan, timeout: float = 30.0) -> dict[str, Any]:
    """{"id", "digest"} of the image as this host has it ({} when the runtime cannot tell)."""
    if cp.runtime in ("podman", "docker"):
        rc, out, _ = _run([cp.runtime, "image", "inspect", "--format", "{{.Id}} {{.Digest}}", cp.image], timeout)
        words = out.split()
        if rc == 0 and words:
            return {"id": words[0], "digest": words[1] if len(words) > 1 and words[1] != "<none>" else ""}
        return {}
    if _is_file_image(cp.image):
        path = os.path.expanduser(cp.image)
        try:
            st = os.stat(path)
        except OSError:
            return {}
        return {"id": f"file:{path}", "digest": f"size={st.st_size} mtime={int(st.st_mtime)}"}
    return {}


def preflight(cp: ContainerPlan, needed: list[str] | tuple[str, ...] = STACK, pull_timeout: float = 1800.0,
              run_timeout: float = 120.0) -> dict[str, Any]:
    """Check this host for the job's container: {"problems": [...], "versions": {...}, "image": {"id", "digest"}}.
    The image is pulled when it is a registry reference the host lacks (podman/docker), which is what the start
    would do anyway; the stack's versions are read by running the image's python."""
    host = socket.gethostname()
    res: dict[str, Any] = {"problems": [], "versions": {}, "image": {}}
    problems: list[str] = res["problems"]
    runtime = cp.runtime
    if runtime == "pyxis":  # on the task step: nothing for the agent to start
        return res
    if shutil.which(runtime) is None:
        problems.append(f"container runtime {runtime} not found on PATH (container.runtime)")
        return res
    for m in cp.mounts:
        path = os.path.expanduser(m.host)
        if not os.path.exists(path):
            problems.append(f"container.mounts: host path {m.host} does not exist" +
                            (f" ({path})" if path != m.host else ""))
    if _is_file_image(cp.image) and not os.path.exists(os.path.expanduser(cp.image)):
        problems.append(f"container image file {cp.image} not found")
        return res
    if runtime in ("podman", "docker"):
        rc, _, _ = _run([runtime, "image", "exists", cp.image], 60) if runtime == "podman" else \
            _run([runtime, "image", "inspect", cp.image], 60)
        if rc != 0:
            rc, out, err = _run([runtime, "pull", "--quiet", cp.image], pull_timeout)
            if rc != 0:
                problems.append(f"container image {cp.image} is not on {host} and cannot be pulled: "
                                f"{_last(err) or _last(out) or f'exit {rc}'}")
                return res
        res["image"] = image_facts(cp)
        argv = [runtime, "run", "--rm", "--network", "none", "--entrypoint", cp.python, *cp.options, cp.image,
                "-c", VERSIONS_SCRIPT, *needed]
    elif runtime == "apptainer":
        res["image"] = image_facts(cp)
        argv = ["apptainer", "exec", *cp.options, cp.image, cp.python, "-c", VERSIONS_SCRIPT, *needed]
    else:  # enroot
        res["image"] = image_facts(cp)
        argv = ["enroot", "start", *cp.options, cp.image, cp.python, "-c", VERSIONS_SCRIPT, *needed]
    rc, out, err = _run(argv, run_timeout)
    line = next((ln for ln in out.splitlines() if ln.startswith("ORCHESTRATE_VERSIONS ")), "")
    if rc != 0 or not line:
        problems.append(f"container image {cp.image}: {cp.python} does not run in it "
                        f"({_last(err) or _last(out) or f'exit {rc}'}) (container.python)")
        return res
    res["versions"] = json.loads(line.split(" ", 1)[1])
    missing = [n for n in needed if res["versions"].get(n) is None]
    if missing:
        problems.append(f"container image {cp.image} has no {', '.join(missing)} (the job needs it)")
    return res


def remove(runtime: str, job_id: str, node_rank: int, timeout: float = 30.0, grace: float = 0.0) -> str:
    """Remove node `node_rank`'s container if anything is left of it (podman/docker); '' or why it failed. `grace`:
    seconds it gets between TERM and KILL (remove_argv)."""
    return remove_named(runtime, container_name(job_id, node_rank), timeout, grace)


def remove_named(runtime: str, name: str, timeout: float = 30.0, grace: float = 0.0) -> str:
    """Remove the container `name` if anything is left of it (podman/docker); '' or why it failed."""
    argv = remove_argv(runtime, name, grace)
    if argv is None or not name or shutil.which(argv[0]) is None:
        return ""
    stop = stop_argv(runtime, name, grace)
    if stop is not None:
        _run(stop, timeout + grace)  # (no such container: rm says so below)
    rc, out, err = _run(argv, timeout + grace)
    if rc == 0 or "no such container" in (err + out).lower() or "no container with name" in (err + out).lower():
        return ""
    return _last(err) or _last(out) or f"exit {rc}"


def leftovers(runtime: str, job_id: str, timeout: float = 30.0) -> list[str]:
    """Names of the containers (any state) that still carry the job's label on this host."""
    argv = list_argv(runtime, job_id)
    if argv is None or shutil.which(argv[0]) is None:
        return []
    rc, out, _ = _run(argv, timeout)
    return out.split() if rc == 0 else []
