"""The dashboard's HTML, from the plain data of `orchestrator.web.data` (pure: no I/O; every value escaped).

A page is a list of sections; the live ones (`Section.live`) are what the page's script fetches again every second
(`?part=1` answers them as JSON {section id: html}) and swaps in when they changed. A state is shown as a word and a
symbol as well as a colour (never by colour alone).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from html import escape
from typing import Any
from urllib.parse import urlencode

from orchestrator.cli.views import fmt_age, fmt_loss

SYMBOLS = {"RUNNING": "▶", "COMPLETED": "✓", "FAILED": "✗", "CANCELLED": "■", "QUEUED": "◔", "PENDING": "○",
           "REQUEUED": "↻", "NOT STARTED": "·"}  # (glyphs every common sans font has: DejaVu, Segoe, SF)
PLOT_MAX_RANKS = 8  # (as plot.DEFAULT_RANKS: the page says which ranks it draws)


@dataclass(frozen=True)
class Section:
    id: str
    html: str
    live: bool = True


def e(v: Any) -> str:
    return escape("" if v is None else str(v), quote=True)


def state_badge(state: str, stale: bool = False) -> str:
    label = f"{SYMBOLS.get(state, '•')} {state}" + (" ?" if stale else "")
    title = " title=\"recorded so, but no supervisor runs it any more: `orchestrate status` asks its backend\"" \
        if stale else ""
    return f'<span class="state st-{e(state.replace(" ", "_"))}"{title}>{e(label)}</span>'


def fmt_dur(s: float | None) -> str:
    return "-" if s is None else fmt_age(s)


def fmt_num(v: Any, digits: int = 0) -> str:
    if not isinstance(v, (int, float)):
        return "-"
    return f"{v:,.{digits}f}"


def clock(t: float | None) -> str:
    return "-" if not t else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def page(title: str, sections: list[Section], token: str | None, body_class: str = "", data: dict | None = None
         ) -> str:
    """A whole page: the head (our own stylesheet and scripts only), the navigation, the sections."""
    attrs = "".join(f' data-{k}="{e(v)}"' for k, v in (data or {}).items())
    meta = f'<meta name="orchestrate-token" content="{e(token)}">' if token else ""
    body = "\n".join(f'<section id="{s.id}"{" data-live" if s.live else ""}>{s.html}</section>' for s in sections)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{e(title)} · orchestrate</title>{meta}
<link rel="stylesheet" href="/static/uPlot.min.css"><link rel="stylesheet" href="/static/style.css">
<script src="/static/uPlot.iife.min.js" defer></script><script src="/static/app.js" defer></script>
</head><body class="{e(body_class)}"{attrs}>
<header><a class="brand" href="/">orchestrate</a><nav><a href="/">Jobs</a><a href="/queue">Queue</a></nav>
<span id="updated" aria-live="polite"></span></header>
<main><h1>{e(title)}</h1>
{body}
</main></body></html>"""


def not_found(what: str, ident: str) -> str:
    return page("Not found", [Section("nf", f"<p>No {e(what)} <code>{e(ident)}</code> in this store "
                                            f"(ORCHESTRATE_HOME). <a href=\"/\">All jobs</a></p>", live=False)], None)


def error_page(status: int, message: str) -> str:
    return page(f"{status}", [Section("err", f"<p>{e(message)}</p><p><a href=\"/\">All jobs</a></p>", live=False)],
                None)


# ------------------------------------------------------------------------------------------------ jobs

def jobs_page(d: dict[str, Any], q: dict[str, str], token: str | None) -> str:
    return page("Jobs", [Section("filters", filters(d, q), live=False), Section("jobs", jobs_table(d, q))], token)


def filters(d: dict[str, Any], q: dict[str, str]) -> str:
    def select(name: str, values: list[str]) -> str:
        opts = "".join(f'<option value="{e(v)}"{" selected" if q.get(name) == v else ""}>{e(v)}</option>'
                       for v in values)
        return f'<label>{name} <select name="{name}"><option value="">any</option>{opts}</select></label>'
    f = d["facets"]
    return (f'<form class="filters" method="get" action="/">{select("state", f["state"])}'
            f'{select("backend", f["backend"])}{select("cluster", f["cluster"])}'
            f'<label>text <input type="search" name="text" value="{e(q.get("text", ""))}" '
            f'placeholder="job id, recipe, cause"></label><button type="submit">Filter</button>'
            f'<a href="/">clear</a></form>')


JOB_COLUMNS = ("Job", "State", "Backend", "Nodes × ranks", "Step", "Loss", "Tokens/s", "Age", "Duration",
               "Queue wait", "Restarts", "Root cause")


def jobs_table(d: dict[str, Any], q: dict[str, str]) -> str:
    counts = ", ".join(f"{n} {e(s)}" for s, n in sorted(d["counts"].items()))
    head = f'<p class="summary">{d["matched"]} of {d["total"]} job(s) shown by the filter' + \
        (f" ({counts})" if counts else "") + "</p>"
    if not d["rows"]:
        return head + "<p>No jobs match.</p>"
    out = [head, '<table class="jobs"><thead><tr>' + "".join(f"<th>{c}</th>" for c in JOB_COLUMNS) +
           "</tr></thead><tbody>"]
    for r in d["rows"]:
        if r.get("header"):
            out.append(f'<tr class="sweep"><td colspan="{len(JOB_COLUMNS)}"><a href="/sweeps/{e(r["sweep"])}">'
                       f'{e(r["sweep"])}</a> {e(r["header"][len(r["sweep"]):].strip())}</td></tr>')
            continue
        per = r["world_size"] // r["nodes"] if r["nodes"] else r["world_size"]
        step = "-" if r.get("step") is None else (f"{r['step']} / {r['max_steps']}" if r.get("max_steps")
                                                  else str(r["step"]))
        name = e(r["id"]) + (f' <span class="muted">{e(" ".join(r.get("overrides") or []))}</span>'
                             if r.get("sweep") else "")
        out.append(f'<tr class="{"point" if r.get("sweep") else ""}"><td><a href="/jobs/{e(r["id"])}">{name}</a></td>'
                   f'<td>{state_badge(r["state"], r.get("stale", False))}'
                   f'{e(" #" + str(r["queue_position"])) if r.get("queue_position") else ""}</td>'
                   f'<td>{e(r["backend"])}</td><td class="num">{r["nodes"]} × {per}</td>'
                   f'<td class="num">{e(step)}</td><td class="num">{fmt_loss(r.get("loss"))}</td>'
                   f'<td class="num">{fmt_num(r.get("tokens_per_s"))}</td>'
                   f'<td class="num">{fmt_age(r["age_s"])}</td><td class="num">{fmt_dur(r.get("run_s"))}</td>'
                   f'<td class="num">{fmt_dur(r.get("queue_wait_s"))}</td><td class="num">{r["restarts"] or 0}</td>'
                   f'<td class="cause">{e((r.get("root_cause") or "")[:200])}</td></tr>')
    out.append("</tbody></table>")
    if d["pages"] > 1:
        links = []
        for p in range(1, d["pages"] + 1):
            qs = urlencode({**{k: v for k, v in q.items() if v and k != "page"}, "page": p})
            links.append(f"<strong>{p}</strong>" if p == d["page"] else f'<a href="/?{e(qs)}">{p}</a>')
        out.append(f'<nav class="pager">page {" ".join(links)}</nav>')
    return "".join(out)


# ------------------------------------------------------------------------------------------------ one job

def job_page(d: dict[str, Any], token: str | None) -> str:
    st = d["status"]
    ranks = d["ranks_total"]
    drawn = "every rank" if ranks <= PLOT_MAX_RANKS else "rank 0"
    sections = [Section("head", job_head(d, token)), Section("plan", plan_section(d), live=False),
                Section("attempts", attempts_section(d)),
                Section("charts", f'<h2>Loss and tokens/s ({drawn})</h2><p class="muted" id="drew"></p>'
                                  '<div class="charts"><div id="chart-loss" class="chart" aria-label="loss per step">'
                                  '</div><div id="chart-speed" class="chart" aria-label="tokens per second"></div>'
                                  '</div>', live=False),
                Section("ranks", ranks_section(d)), Section("log", log_section(d), live=False),
                Section("nodes", nodes_section(d))]
    return page(f"Job {st['job']}", sections, token, "job", {"job": st["job"]})


def job_head(d: dict[str, Any], token: str | None) -> str:
    from orchestrator.types import is_terminal
    st, t = d["status"], d["times"]
    rows = [("State", state_badge(st["state"], d["stale"]) + (f' exit {e(st["exit_code"])}'
                                                             if st["exit_code"] is not None else "")),
            ("Backend", f"{e(st['backend'])} {e(st['handle'] or '')}"), ("Cluster", e(st["cluster"])),
            ("Created", e(clock(st["created"]))), ("Queue wait", fmt_dur(t["queue_wait_s"])),
            ("Duration", fmt_dur(t["run_s"])), ("Restarts", e(st["restarts"])), ("Run dir", f"<code>{e(st['run_dir'])}"
                                                                                           "</code>")]
    if st.get("root_cause"):
        rows.append(("Root cause", f'<span class="cause">{e(st["root_cause"])}</span>'))
    q = st.get("queue")
    if q:
        rows.append(("Queue", (f"#{e(q['position'])} in this store's queue; " if q.get("position") else "") +
                     f"waiting for {e(q.get('waiting_for') or 'leased hosts')}"))
    if d["stale"]:
        rows.append(("Note", "recorded as running, but no supervisor runs it any more (`orchestrate status "
                             f"{e(st['job'])}` asks its backend and records its end)"))
    html = '<dl class="facts">' + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows) + "</dl>"
    if not is_terminal(st["state"]):
        if token:
            html += ('<p><button class="cancel" data-cancel="' + e(st["job"]) + '">Cancel job</button> '
                     '<span id="cancel-result" aria-live="polite"></span></p>')
        else:
            html += '<p class="muted">Cancel: open the URL the dashboard printed (it carries the access token).</p>'
    return html


def plan_section(d: dict[str, Any]) -> str:
    p = d["plan"]
    if p is None:
        return "<h2>Plan</h2><p>No plan recorded.</p>"
    hosts = ", ".join(p["hosts"]) + (f" and {p['hosts_more']} more" if p["hosts_more"] else "")
    rows = [("Hosts", e(hosts)), ("Profile", e(p["profile"])),
            ("World size", f"{p['nodes']} node(s) × {p['procs_per_node']} = {p['world_size']}"),
            ("Effective batch", fmt_num(p["effective_batch"])), ("Tokens per step", fmt_num(p["tokens_per_step"])),
            ("Container", e(p["container"] or "none"))]
    return ('<h2>Plan</h2><dl class="facts">' + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows) + "</dl>"
            f'<details><summary>The plan as <code>render</code> prints it</summary><pre>{e(p["text"])}</pre>'
            f'</details><details><summary>Node 0: environment (secrets masked) and command</summary>'
            f'<pre>{e(p["command"])}</pre></details>')


def attempts_section(d: dict[str, Any]) -> str:
    st = d["status"]
    out = []
    if st.get("attempts"):
        out.append("<h2>Attempts</h2><table><thead><tr><th>Attempt</th><th>Decision</th><th>Kind</th><th>Host</th>"
                   "<th>Step</th><th>Why</th></tr></thead><tbody>")
        for a in st["attempts"]:
            out.append(f"<tr><td>{e(a['attempt'])}</td><td>{e(a['decision'])}</td><td>{e(a['kind'])}</td>"
                       f"<td>{e(a['host'])}</td><td>{e(a['step'])}</td><td>{e(a['reason'])}</td></tr>")
        out.append("</tbody></table>")
    if st.get("excluded"):
        out.append("<h2>Excluded hosts</h2><ul>" + "".join(f"<li><strong>{e(h)}</strong>: {e(why)}</li>"
                                                            for h, why in st["excluded"].items()) + "</ul>")
    if d.get("diagnosis"):
        diag = d["diagnosis"]
        text = diag.get("summary") or diag.get("verdict") or diag.get("text") or ""
        import json
        out.append(f'<h2>Hang diagnosis</h2><p class="cause">{e(text)}</p><details><summary>the whole record'
                   f'</summary><pre>{e(json.dumps(diag, indent=2, sort_keys=True, default=str))}</pre></details>')
    if st.get("stragglers"):
        out.append("<h2>Slow ranks</h2><ul>" + "".join(
            f"<li>rank {e(s.get('rank'))} on {e(s.get('host') or '?')}: {e(s.get('ratio'))}× the others' forward "
            f"time per step (attempt {e(s.get('attempt'))}, step {e(s.get('step'))}, {e(s.get('action'))})</li>"
            for s in st["stragglers"]) + "</ul>")
    return "".join(out)


def nodes_section(d: dict[str, Any]) -> str:
    from orchestrator.types import exit_text
    st = d["status"]
    nodes = st["nodes"]
    out = ["<h2>Nodes</h2>"]
    if d.get("node_summary"):
        out.append(f'<p class="summary">{e(d["node_summary"])}</p>')
    if not nodes:
        return "".join(out) if d.get("node_summary") else ""
    out.append("<table><thead><tr><th>Node</th><th>Host</th><th>Ranks</th><th>End</th><th>Exit</th><th>Note</th>"
               "</tr></thead><tbody>")
    for n in nodes:
        ranks = f"{n['ranks'][0]}-{n['ranks'][-1]}" if n["ranks"] else "-"
        out.append(f"<tr><td>{e(n['node'])}</td><td>{e(n['host'])}</td><td>{ranks}</td><td>{e(n.get('end') or '-')}"
                   f"</td><td>{e(exit_text(n['exit_code']))}</td><td>{e(n.get('note') or '')}</td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


def ranks_section(d: dict[str, Any]) -> str:
    out = ["<h2>Ranks</h2>"]
    if d.get("ranks_summary"):
        out.append(f'<p class="summary">{e(d["ranks_summary"])}</p>')
    if d["ranks_total"] > 64 or d.get("ranks_page"):
        job = d["status"]["job"]
        links = [f'<a href="/jobs/{e(job)}">the notable ones</a>'] + [
            (f"<strong>{p}</strong>" if p == d.get("ranks_page") else
             f'<a href="/jobs/{e(job)}?ranks_page={p}">{p}</a>')
            for p in range(1, d["ranks_pages"] + 1)]
        out.append(f'<nav class="pager">ranks: {" ".join(links)}</nav>')
    if not d["ranks"]:
        out.append("<p>No rank has reported yet.</p>")
        return "".join(out)
    out.append('<table class="ranks"><thead><tr><th>Rank</th><th>Node</th><th>Host</th><th>State</th><th>Step</th>'
               "<th>Loss</th><th>Heartbeat age</th><th>Forward / step</th></tr></thead><tbody>")
    for r in d["ranks"]:
        step = "-" if r["step"] is None else (f"{r['step']} / {r['max_steps']}" if r["max_steps"] else str(r["step"]))
        fwd = "-" if r.get("compute_s") is None else f"{r['compute_s'] * 1000:.1f} ms"
        slow = r.get("straggler")
        if slow:
            fwd = f'<span class="slow" title="{e(slow.get("ratio"))}× the others">SLOW</span> {fwd}'
        out.append(f'<tr data-rank="{e(r["rank"])}"><td>{e(r["rank"])}</td><td>{e(r["node"])}</td>'
                   f'<td>{e(r["host"])}</td><td>{e(r["state"])}</td><td class="num step">{e(step)}</td>'
                   f'<td class="num">{fmt_loss(r["loss"])}</td><td class="num">{fmt_age(r["heartbeat_age_s"])}</td>'
                   f'<td class="num">{fwd}</td></tr>')
    out.append("</tbody></table>")
    return "".join(out)


def log_section(d: dict[str, Any]) -> str:
    st = d["status"]
    ranks = d["ranks_total"]
    nodes = st.get("nodes") or []
    many = len(nodes) > 8 or bool(d.get("node_summary"))
    rank_opts = "".join(f'<option value="{g}">rank {g}</option>' for g in range(min(ranks, 64)))
    node_field = ('<label>node <input type="number" min="0" name="node" id="log-node" value="0"></label>'
                  if many else "")
    return (f'<h2>Log</h2><form class="filters" id="log-form" onsubmit="return false">'
            f'<label>rank <select id="log-rank"><option value="">all</option>{rank_opts}</select></label>'
            f'{node_field}<label>search <input type="search" id="log-text" placeholder="text in a line"></label>'
            f'<label><input type="checkbox" id="log-follow" checked> follow</label></form>'
            f'<pre id="log-lines" class="log" tabindex="0"></pre>')


# ------------------------------------------------------------------------------------------------ sweeps, queue

def sweep_page(d: dict[str, Any], token: str | None) -> str:
    return page(f"Sweep {d['id']}", [Section("points", sweep_points(d)),
                                     Section("charts", '<h2>Loss of every point (rank 0)</h2><p class="muted" '
                                                       'id="drew"></p><div id="chart-sweep" class="chart wide"></div>',
                                             live=False)], token, "sweep", {"sweep": d["id"]})


def sweep_points(d: dict[str, Any]) -> str:
    best = d.get("best")
    out = [f'<p class="summary">{len(d["points"])} point(s), at most {e(d.get("max_parallel"))} at once; job file '
           f'<code>{e(d.get("job_file"))}</code>' + (f" {e(' '.join(d['overrides']))}" if d["overrides"] else "") +
           "</p>"]
    if best:
        out.append(f'<p class="best">Best: <a href="/jobs/{e(best["job"])}">{e(best["point"])}</a> '
                   f'{e(" ".join(best["overrides"]))}: final loss {fmt_loss(best["final_loss"])}</p>')
    out.append("<table><thead><tr><th>Point</th><th>State</th><th>Step</th><th>Final loss</th><th>Best loss</th>"
               "<th>Overrides</th><th>Note</th></tr></thead><tbody>")
    for r in d["points"]:
        note = r.get("stopped_early") and f"stopped early: {r['stopped_early']}" or r.get("not_started") or \
            r.get("root_cause") or ""
        out.append(f'<tr><td><a href="/jobs/{e(r["job"])}">{e(r["point"])}</a></td><td>{state_badge(r["state"])}</td>'
                   f'<td class="num">{e(r["step"] if r["step"] is not None else "-")}</td>'
                   f'<td class="num">{fmt_loss(r["final_loss"])}</td><td class="num">{fmt_loss(r["best_loss"])}</td>'
                   f'<td><code>{e(" ".join(r["overrides"]))}</code></td><td class="cause">{e(note)}</td></tr>')
    out.append("</tbody></table>")
    return "".join(out)


def queue_page(d: dict[str, Any], token: str | None) -> str:
    return page("Queue", [Section("queue", queue_table(d))], token)


def holder_cell(h: dict[str, Any], now: float) -> str:
    who = h.get("holder") or {}
    job = who.get("job")
    since = who.get("since")
    return (f'{e(h.get("what") or h.get("host"))}: ' +
            (f'<a href="/jobs/{e(job)}">{e(job)}</a>' if job else "another job (not recorded yet)") +
            (f' <span class="who">{e(who.get("submitter"))}</span>' if who.get("submitter") else "") +
            (f', agent pid {e(who.get("pid"))}' if who.get("pid") else "") +
            (f', since {e(clock(since))} ({fmt_age(now - since)})' if isinstance(since, (int, float)) else ""))


def queue_table(d: dict[str, Any]) -> str:
    now = d["now"]
    out = [f'<h2>Queued ({len(d["queued"])})</h2>']
    if not d["queued"]:
        out.append("<p>No job waits for leased hosts or GPUs.</p>")
    else:
        out.append("<table><thead><tr><th>#</th><th>Job</th><th>Nodes</th><th>Cluster</th><th>Waiting since</th>"
                   "<th>Held by</th></tr></thead><tbody>")
        for w in d["queued"]:
            held = "<br>".join(holder_cell(h, now) for h in w["holders"]) or e(w["waiting_for"] or "leased hosts")
            since = w["since"] or w["created"]
            out.append(f'<tr><td class="num">{e(w["position"] or "-")}</td><td><a href="/jobs/{e(w["id"])}">'
                       f'{e(w["id"])}</a> {state_badge("QUEUED", w["stale"])}</td><td class="num">{e(w["nodes"])}</td>'
                       f'<td>{e(w["cluster"])}</td><td>{e(clock(since))} ({fmt_age(now - since)})</td>'
                       f'<td class="holder">{held}</td></tr>')
        out.append("</tbody></table>")
    out.append(f'<h2>Running ({len(d["running"])})</h2>')
    if d["running"]:
        out.append("<table><thead><tr><th>Job</th><th>State</th><th>Nodes</th><th>Cluster</th><th>Since</th></tr>"
                   "</thead><tbody>" + "".join(
                       f'<tr><td><a href="/jobs/{e(r["id"])}">{e(r["id"])}</a></td><td>{state_badge(r["state"])}</td>'
                       f'<td class="num">{e(r["nodes"])}</td><td>{e(r["cluster"])}</td>'
                       f'<td>{e(clock(r["since"]))}</td></tr>' for r in d["running"]) + "</tbody></table>")
    else:
        out.append("<p>None.</p>")
    return "".join(out)
