"""The dashboard's ASGI app (starlette) and its server (uvicorn): routes, the access token, the safety rules.

Routes: pages `/` (jobs), `/jobs/<id>`, `/sweeps/<id>`, `/queue` (each also answers `?part=1`: its live sections as
JSON, what the page's script fetches every second); data `/api/jobs/<id>/series`, `/api/jobs/<id>/log`,
`/api/sweeps/<id>/curves`; the one action `POST /api/jobs/<id>/cancel`; `/static/*` (shipped in the package).

Safety: a random token per server start (secrets.token_urlsafe). Bound to a loopback address, pages need no token;
bound to any other, every request needs it (the `?token=` of the printed URL sets an HttpOnly, SameSite=Strict
cookie). Cancel always needs it, in the X-Orchestrate-Token header of a POST whose Origin (when sent) is this server:
a cross-site form or link cannot cancel. Every request's Host must name this server (no DNS rebinding). Pages are
never framed (clickjacking) and load nothing but this server's own files (Content-Security-Policy). Reading never
writes; a bad id is a 404 page; any error is a one-line 500 page (the traceback goes to the server's log only).
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.web import data, pages

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "orchestrate_token"
HEADER = "x-orchestrate-token"
log = logging.getLogger("orchestrate.dashboard")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def create_app(token: str, bind_host: str = "127.0.0.1", port: int | None = None):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    loopback = is_loopback(bind_host)
    told: set[str] = set()

    def authed(request: Request) -> bool:
        given = request.headers.get(HEADER) or request.cookies.get(COOKIE) or request.query_params.get("token") or ""
        return secrets.compare_digest(given.encode(), token.encode())

    def host_ok(request: Request) -> bool:
        if not loopback:  # (any name may reach it; the token guards every request)
            return True
        host = request.headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name.strip("[]") in ("127.0.0.1", "localhost", "::1", bind_host)

    class Guard:
        """Host check, the token rule, the security headers: around every request."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            request = Request(scope)
            if not host_ok(request):
                return await _send(PlainTextResponse("unknown Host", 421), scope, receive, send)
            if not loopback and not authed(request):
                return await _send(HTMLResponse(pages.error_page(
                    403, "This dashboard needs its access token: open the URL it printed (with ?token=...)."), 403),
                    scope, receive, send)
            if request.query_params.get("token") and request.method == "GET" and authed(request):
                # the printed URL: keep the token in a cookie, and drop it from the address bar (and history)
                rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                from urllib.parse import urlencode
                target = request.url.path + ("?" + urlencode(rest) if rest else "")
                resp = RedirectResponse(target, 303)
                resp.set_cookie(COOKIE, token, httponly=True, samesite="strict", path="/")
                return await _send(resp, scope, receive, send)

            t0 = time.perf_counter()

            async def send_headers(message):
                if message["type"] == "http.response.start":
                    headers = list(message.get("headers", []))
                    headers.append((b"server-timing", f"app;dur={(time.perf_counter() - t0) * 1000:.1f}".encode()))
                    headers += [(b"content-security-policy", b"default-src 'self'; style-src 'self' 'unsafe-inline'; "
                                 b"img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
                                (b"x-frame-options", b"DENY"), (b"referrer-policy", b"no-referrer"),
                                (b"x-content-type-options", b"nosniff")]
                    message = dict(message, headers=headers)
                await send(message)
            try:
                return await self.app(scope, receive, send_headers)
            except Exception:  # noqa: BLE001 - starlette re-raises what it answered with the 500 page (server_error
                return None  # logged it, its traceback once): not again into the server's output on every poll

    def page_token(request: Request) -> str | None:
        """The token, in the page, only for a request that showed it (the page's Cancel sends it back)."""
        return token if authed(request) else None

    def query(request: Request) -> dict[str, str]:
        return {k: request.query_params.get(k, "") for k in ("state", "backend", "cluster", "text", "page")}

    def int_param(request: Request, name: str) -> int | None:
        v = request.query_params.get(name)
        if v in (None, ""):
            return None
        try:
            n = int(v)
        except ValueError:
            raise HTTPException(400, f"{name}: not a number") from None
        if n < 0:
            raise HTTPException(400, f"{name}: must be >= 0")
        return n

    def offsets_param(request: Request) -> dict[int, int] | None:
        raw = request.query_params.get("off")
        if raw is None:
            return None
        out = {}
        for item in filter(None, raw.split(",")):
            k, _, v = item.partition(":")
            try:
                out[int(k)] = max(0, int(v))
            except ValueError:
                raise HTTPException(400, "off: rank:offset,...") from None
        return out

    async def jobs_page(request: Request) -> Response:
        q = query(request)
        try:
            page_no = int(q["page"] or 1)
        except ValueError:
            page_no = 1
        d = await _thread(data.jobs, q["state"], q["backend"], q["cluster"], q["text"], page_no)
        if request.query_params.get("part"):
            return JSONResponse({"jobs": pages.jobs_table(d, q)})
        return HTMLResponse(pages.jobs_page(d, q, page_token(request)))

    async def job_page(request: Request) -> Response:
        job = request.path_params["job"]
        d = await _thread(data.job, job, int_param(request, "ranks_page"))
        if request.query_params.get("part"):
            return JSONResponse({"head": pages.job_head(d, page_token(request)), "attempts": pages.attempts_section(d),
                                 "nodes": pages.nodes_section(d), "ranks": pages.ranks_section(d)})
        return HTMLResponse(pages.job_page(d, page_token(request)))

    async def sweep_page(request: Request) -> Response:
        d = await _thread(data.sweep, request.path_params["sweep"])
        if request.query_params.get("part"):
            return JSONResponse({"points": pages.sweep_points(d)})
        return HTMLResponse(pages.sweep_page(d, page_token(request)))

    async def queue_page(request: Request) -> Response:
        d = await _thread(data.queue)
        if request.query_params.get("part"):
            return JSONResponse({"queue": pages.queue_table(d)})
        return HTMLResponse(pages.queue_page(d, page_token(request)))

    async def series(request: Request) -> Response:
        return JSONResponse(await _thread(data.series, request.path_params["job"], offsets_param(request)))

    async def job_log(request: Request) -> Response:
        d = await _thread(data.log, request.path_params["job"], int_param(request, "rank"),
                          int_param(request, "node"), request.query_params.get("q", "")[:200], offsets_param(request))
        return JSONResponse(d)

    async def sweep_curves(request: Request) -> Response:
        return JSONResponse(await _thread(data.sweep_curves, request.path_params["sweep"]))

    async def cancel(request: Request) -> Response:
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.headers.get('host', '')}":
            return JSONResponse({"error": "cross-site request refused"}, 403)
        if not secrets.compare_digest((request.headers.get(HEADER) or "").encode(), token.encode()):
            return JSONResponse({"error": f"Cancel needs the access token (the {HEADER} header)"}, 403)
        job = request.path_params["job"]
        state = await _thread(data.cancel, job)
        log.warning("cancel %s from %s: %s", job, request.client.host if request.client else "?", state)
        return JSONResponse({"job": job, "state": state})

    async def not_found(request: Request, exc: Exception) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": f"not found: {exc}"}, 404)
        what = "sweep" if request.url.path.startswith("/sweeps/") else "job" if request.url.path.startswith(
            "/jobs/") else "page"
        return HTMLResponse(pages.not_found(what, str(exc) if what != "page" else request.url.path), 404)

    async def http_error(request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 500)
        if code == 404:
            return await not_found(request, exc)
        detail = getattr(exc, "detail", "")
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": detail}, code)
        return HTMLResponse(pages.error_page(code, str(detail)), code)

    async def server_error(request: Request, exc: Exception) -> Response:
        said = f"{type(exc).__name__}: {exc}"  # (a page polled every second: its traceback once, then one line)
        log.error("%s %s: %s", request.method, request.url.path, said, exc_info=exc if said not in told else None)
        told.add(said)
        msg = f"{type(exc).__name__}: {str(exc)[:300]}"
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": msg}, 500)
        return HTMLResponse(pages.error_page(500, msg), 500)

    routes = [Route("/", jobs_page), Route("/jobs/{job}", job_page), Route("/sweeps/{sweep}", sweep_page),
              Route("/queue", queue_page), Route("/api/jobs/{job}/series", series),
              Route("/api/jobs/{job}/log", job_log), Route("/api/sweeps/{sweep}/curves", sweep_curves),
              Route("/api/jobs/{job}/cancel", cancel, methods=["POST"]),
              Mount("/static", StaticFiles(directory=str(STATIC)), name="static")]
    from orchestrator.errors import OrchestratorError

    async def orchestrator_error(request: Request, exc: Exception) -> Response:
        return await http_error(request, HTTPException(409 if "cancel" in request.url.path else 500, str(exc)))

    app = Starlette(routes=routes, exception_handlers={
        data.NotFound: not_found, HTTPException: http_error, OrchestratorError: orchestrator_error,
        Exception: server_error})
    return Guard(app)


async def _thread(fn, *args: Any) -> Any:
    from starlette.concurrency import run_in_threadpool
    return await run_in_threadpool(fn, *args)


async def _send(response, scope, receive, send) -> None:
    await response(scope, receive, send)


def serve(host: str = "127.0.0.1", port: int = 8470, say=print) -> int:
    """Bind, print the URL (with the token), serve until Ctrl-C."""
    import socket

    import uvicorn
    token = secrets.token_urlsafe(24)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        from orchestrator.errors import ConfigError, Problem
        raise ConfigError(Problem("--port" if e.errno == 98 else "--host", f"cannot listen on {host}:{port}: "
                                  f"{e.strerror or e}")) from None
    sock.listen(128)
    sock.set_inheritable(True)
    real_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    say(f"orchestrate dashboard: http://{shown}:{real_port}/?token={token}")
    if is_loopback(host):
        say("  (this machine only; from your laptop: ssh -L "
            f"{real_port}:127.0.0.1:{real_port} THIS_HOST, then open the URL above; Ctrl-C stops)")
    else:
        say(f"  (listening on {host}: every request needs the token; prefer --host 127.0.0.1 and ssh -L "
            f"{real_port}:127.0.0.1:{real_port} THIS_HOST; Ctrl-C stops)")
    sys.stdout.flush()
    logging.basicConfig(level=logging.WARNING, format="dashboard: %(message)s")
    config = uvicorn.Config(create_app(token, host, real_port), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return 0

