"""The network pre-flight every rank runs at start, before the model loads: a wrong interface, a firewall or a broken
backend becomes a named failure within seconds instead of a rendezvous or first collective that hangs for minutes.

`check(timeout_s)` (standard library + torch, imported only here, in the rank):
1. joins the launcher's own rendezvous store (torchrun's agent store at MASTER_ADDR:MASTER_PORT, which every rank of
   an `accelerate launch` reaches anyway) under a key prefix of its own: nothing of the user's process group is
   touched, so the user's `init_process_group` afterwards is unaffected;
2. node level: local rank 0 of every node listens on the address of the interface the backend will use
   (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, else the one that routes to the main node) and connects to every other
   node's listener: who cannot reach whom is named (node, host, interface, address, error);
3. all ranks: a one-element all-reduce in a separate process group (gloo on CPU, NCCL on GPU) over the real
   interface, checked to sum to the world size; then the group is shut down.
Everything runs under one deadline of `timeout_s` seconds (`health.preflight_timeout`, 0 disables it). A failure
raises `PreflightFailed`; `run_from_env()` prints it as one `PreflightError: ...` line (the supervisor's root cause)
and returns EXIT_CODE. It runs once per process (ORCHESTRATE_PREFLIGHT_DONE), so the ranks' start-up hook and
`recipes.run` may both call it.

Environment: ORCHESTRATE_PREFLIGHT_TIMEOUT (seconds; unset: not under an orchestrate plan, skipped), the torchrun
variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RESTART_COUNT), ORCHESTRATE_ACCELERATOR, GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME. Skipped for a world of 1 and outside a torchrun launch (no agent store to meet at).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from orchestrator.node.netcheck import interface_address, interface_names, route_interface

EXIT_CODE = 69  # EX_UNAVAILABLE: the network the job needs is not there
TIMEOUT_VAR = "ORCHESTRATE_PREFLIGHT_TIMEOUT"
DONE_VAR = "ORCHESTRATE_PREFLIGHT_DONE"
PREFIX = "orchestrate/preflight"


class PreflightFailed(RuntimeError):
    """The pre-flight found a problem; the message names the nodes, the interface and the backend."""


def _int(value: str | None, default: int) -> int:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return default


def _interface(spec: str) -> str | None:
    """The interface a GLOO/NCCL_SOCKET_IFNAME value selects (its first entry; NCCL's `=` exact and prefix forms)."""
    first = spec.split(",")[0].strip()
    if not first or first.startswith("^"):
        return None
    names = interface_names()
    if first.startswith("="):
        return first[1:] if first[1:] in names else None
    return first if first in names else next((n for n in names if n.startswith(first)), None)


class _Deadline:
    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.seconds = seconds
        self.end = self.start + seconds

    def left(self, floor: float = 0.05) -> float:
        return max(floor, self.end - time.monotonic())

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def _wait_keys(store: Any, keys: list[str], deadline: _Deadline) -> list[str]:
    """Wait for `keys`; the ones still missing at the deadline (empty: all there)."""
    from datetime import timedelta
    try:
        store.wait(keys, timedelta(seconds=deadline.left()))
        return []
    except Exception:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError on a wait timeout
        return [k for k in keys if not _has(store, k)]


def _has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001 - a store that went away: the key is not there
        return False


def _arrive(store: Any, name: str, count: int) -> None:
    """One arrival at barrier `name` of `count`; the last one sets `name/all` (everyone waits on that one key)."""
    if store.add(f"{name}/n", 1) >= count:
        store.set(f"{name}/all", "1")


def _fail(store: Any, message: str, *barriers: str) -> None:
    """Publish the first failure (later ones keep it) and release whoever waits at `barriers`."""
    store.compare_set("fail", "", message)
    for name in barriers:
        store.set(f"{name}/all", "1")


def _listen(address: str | None) -> socket.socket:
    family = socket.AF_INET6 if address and ":" in address else socket.AF_INET
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((address or "", 0))
    srv.listen(128)

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return  # closed
            conn.close()
    threading.Thread(target=accept, daemon=True, name="preflight-listen").start()
    return srv


def _connect(addr: str, port: int, timeout: float) -> str | None:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return "connection refused"
    except socket.timeout:
        return f"no answer within {timeout:.1f} s (packets dropped: a firewall?)"
    except OSError as e:
        return e.strerror or str(e)


def _who(n: int, info: dict[str, Any]) -> str:
    where = f"{info.get('ifname') or '?'} {info.get('addr') or '?'}"
    return f"node {n} ({info.get('host', '?')}, {where})"


def _node_level(ps: Any, node: int, nodes: int, host: str, ifname: str | None, spec: str, via: str,
                timeout_s: float, deadline: _Deadline) -> socket.socket | None:
    """Local rank 0 of a node: listen on the backend's interface, publish where, connect to every other node's
    listener, publish who could not be reached; the last node to report judges (all nodes' reports) and publishes the
    first failure. Returns the listener (closed by the caller once every rank is through)."""
    srv = None
    info: dict[str, Any] = {"host": host, "ifname": ifname}
    addr = interface_address(ifname) if ifname else None
    if spec and not spec.startswith("^") and ifname is None:
        info["error"] = f"{spec!r} selects no interface on node {node} ({host}) (its interfaces: " \
                        f"{', '.join(interface_names())})"
    elif addr is None:
        info["error"] = f"interface {ifname or '(none routes to the main node)'} has no address on node {node} ({host})"
    else:
        try:
            srv = _listen(addr)
            info.update(addr=addr, port=srv.getsockname()[1])
        except OSError as e:
            info["error"] = f"node {node} ({host}) cannot listen on {addr} ({e.strerror or e})"
    ps.set(f"node/{node}", json.dumps(info))
    _arrive(ps, "nodes", nodes)
    if _wait_keys(ps, ["nodes/all"], deadline):
        gone = [str(n) for n in range(nodes) if not _has(ps, f"node/{n}")]
        _fail(ps, f"node(s) {', '.join(gone)} did not join the pre-flight within {timeout_s:g} s ({via})", "reach")
        return srv
    infos = {n: json.loads(v) for n, v in enumerate(ps.multi_get([f"node/{n}" for n in range(nodes)]))}
    errors = [i["error"] for i in infos.values() if i.get("error")]
    if errors:
        _fail(ps, "network pre-flight failed: " + "; ".join(errors[:6]), "reach")
        return srv
    others = [n for n in range(nodes) if n != node]
    per = min(2.0, deadline.left())
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(others)))) as pool:
        results = list(pool.map(lambda n: (n, _connect(infos[n]["addr"], infos[n]["port"], per)), others))
    ps.set(f"reach/{node}", json.dumps([[n, why] for n, why in results if why]))
    if ps.add("reach/n", 1) >= nodes:  # the last node to report judges them all, then releases everyone
        reports = [json.loads(v) for v in ps.multi_get([f"reach/{n}" for n in range(nodes)])]
        pairs = [f"{_who(n, infos[n])} cannot reach {_who(m, infos[m])}:{infos[m]['port']}: {why}"
                 for n, failures in enumerate(reports) for m, why in failures]
        if pairs:
            shown = "; ".join(pairs[:6]) + (f"; and {len(pairs) - 6} more" if len(pairs) > 6 else "")
            ps.compare_set("fail", "", f"network pre-flight failed ({via}): {shown}")
        ps.set("reach/all", "1")
    return srv


def check(timeout_s: float) -> dict[str, Any] | None:
    """Run the pre-flight in this rank; None when it does not apply (disabled, world of 1, done already, not under a
    torchrun launch), else timings. Raises PreflightFailed naming what cannot reach what."""
    env = os.environ
    world = _int(env.get("WORLD_SIZE"), 1)
    if timeout_s <= 0 or world <= 1 or env.get(DONE_VAR) == "1":
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not env.get("MASTER_ADDR"):
        return None
    deadline = _Deadline(timeout_s)
    rank, local_rank = _int(env.get("RANK"), 0), _int(env.get("LOCAL_RANK"), 0)
    local_world = max(1, _int(env.get("LOCAL_WORLD_SIZE"), 1))
    node = _int(env.get("GROUP_RANK"), rank // local_world)
    nodes = max(1, _int(env.get("GROUP_WORLD_SIZE"), max(1, world // local_world)))
    main, port = env["MASTER_ADDR"], _int(env.get("MASTER_PORT"), 29500)
    host = socket.gethostname()

    t_import = time.monotonic()
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    import_s = time.monotonic() - t_import  # paid by the user's code anyway: not a cost of the check itself

    gpu = env.get("ORCHESTRATE_ACCELERATOR") == "gpu" and torch.cuda.is_available()
    backend = "nccl" if gpu else "gloo"
    spec = env.get("NCCL_SOCKET_IFNAME" if gpu else "GLOO_SOCKET_IFNAME", "")
    ifname = _interface(spec) if spec else None
    if ifname is None and (not spec or spec.startswith("^")):
        ifname = route_interface(main)[0]  # what the backend falls back to, near enough: the route to the main node
    via = f"interface {ifname or spec or '?'}, backend {backend}"
    times: dict[str, Any] = {"backend": backend, "ifname": ifname, "nodes": nodes, "world": world,
                             "import_s": round(import_s, 3)}

    try:
        store = dist.TCPStore(main, port, is_master=False, timeout=timedelta(seconds=deadline.left()),
                              wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - torch raises several types for an unreachable store
        raise PreflightFailed(f"node {node} ({host}) cannot reach the rendezvous store {main}:{port} within "
                              f"{timeout_s:g} s ({via}): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                              ) from None
    ps = dist.PrefixStore(f"{PREFIX}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    times["store_s"] = round(deadline.elapsed(), 3)

    # -- 2. node level: every node's local rank 0 listens on the backend's interface and connects to the others
    srv = _node_level(ps, node, nodes, host, ifname, spec, via, timeout_s, deadline) if local_rank == 0 else None
    try:
        if _wait_keys(ps, ["reach/all"], deadline):
            raise PreflightFailed(f"the nodes did not finish the reachability check within {timeout_s:g} s ({via})")
        failure = ps.get("fail").decode(errors="replace") if _has(ps, "fail") else ""
        if failure:
            raise PreflightFailed(failure)
        times["reach_s"] = round(deadline.elapsed(), 3)

        # -- 3. all ranks: a one-element all-reduce in a process group of its own
        outcome: dict[str, Any] = {}

        def collective() -> None:
            try:
                pg_store = dist.PrefixStore("pg", ps)
                pg_timeout = timedelta(seconds=deadline.left(1.0))
                if backend == "nccl":
                    torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = pg_timeout
                    pg = dist.ProcessGroupNCCL(pg_store, rank, world, opts)
                    t = torch.ones(1, device="cuda")
                else:
                    pg = dist.ProcessGroupGloo(pg_store, rank, world, pg_timeout)
                    t = torch.ones(1)
            except (AttributeError, TypeError, ImportError) as e:  # this torch's API, not the network
                outcome["skip"] = f"{type(e).__name__}: {e}"
                return
            except Exception as e:  # noqa: BLE001 - reported below with the nodes and interface
                outcome["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                return
            try:
                pg.allreduce([t]).wait()
                if backend == "nccl":
                    torch.cuda.synchronize()
                outcome["value"] = float(t.item())
                outcome["pg"] = pg
            except Exception as e:  # noqa: BLE001 - reported below with the nodes and interface
                outcome["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        worker = threading.Thread(target=collective, daemon=True, name="preflight-allreduce")
        worker.start()
        worker.join(deadline.left())
        if "skip" in outcome:
            raise RuntimeError(f"the all-reduce check does not fit this torch ({outcome['skip']})")
        if worker.is_alive() or "error" in outcome:
            what = outcome.get("error") or f"did not finish within {timeout_s:g} s"
            raise PreflightFailed(f"all-reduce over {backend} ({via}) failed on rank {rank}, node {node} ({host}): "
                                  f"{what}")
        if outcome.get("value") != float(world):
            raise PreflightFailed(f"all-reduce over {backend} ({via}) on rank {rank} gave {outcome.get('value')}, "
                                  f"expected {world}")
        _arrive(ps, "done", world)
        if _wait_keys(ps, ["done/all"], deadline):  # nobody tears down a peer's connections mid-collective
            raise PreflightFailed(f"not every rank finished the all-reduce within {timeout_s:g} s ({via})")
        pg = outcome.pop("pg", None)
        stop = getattr(pg, "shutdown", None) or getattr(pg, "_shutdown", None)
        if backend == "nccl" and stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - best effort: the group is dropped anyway
                pass
        del pg
    finally:
        if srv is not None:
            srv.close()
    times["allreduce_s"] = round(deadline.elapsed(), 3)
    times["total_s"] = times["allreduce_s"]
    times["check_s"] = round(times["total_s"] - import_s, 3)
    env[DONE_VAR] = "1"
    return times


def run_from_env() -> int:
    """The pre-flight as configured by the plan (ORCHESTRATE_PREFLIGHT_TIMEOUT): 0 when it passed or does not apply,
    EXIT_CODE after printing `PreflightError: ...` on stderr. An unexpected error of our own is reported and skipped
    (it never fails a healthy run)."""
    raw = os.environ.get(TIMEOUT_VAR, "").strip()
    try:
        timeout = float(raw) if raw else 0.0
    except ValueError:
        timeout = 0.0
    try:
        times = check(timeout)
    except PreflightFailed as e:
        print(f"PreflightError: {e}", file=sys.stderr, flush=True)
        return EXIT_CODE
    except Exception as e:  # noqa: BLE001 - a bug of ours must not stop a healthy job
        print(f"orchestrate preflight: skipped ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return 0
    if times is not None and _int(os.environ.get("RANK"), 0) == 0:
        print(f"orchestrate preflight: ok in {times['check_s']:.2f} s after importing torch ({times['import_s']:.2f} s;"
              f" {times['nodes']} node(s), {times['world']} ranks, {times['backend']} over "
              f"{times['ifname'] or 'the default interface'}; store {times['store_s']:.2f} s, nodes reachable "
              f"{times['reach_s']:.2f} s, all-reduce {times['allreduce_s']:.2f} s)", flush=True)
    return 0


def exit_on_failure() -> None:
    """For a start-up hook: run the pre-flight and end the process with EXIT_CODE when it fails."""
    code = run_from_env()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
