"""The dashboard: a second face beside cli/ (`orchestrate dashboard`): a live site of this store's jobs, sweeps and
queue. `data` reads through the CLI's own readers and acts only through the public API (Job.cancel); `pages` turns
that data into HTML; `app` serves it (starlette + uvicorn, imported only when the dashboard starts); `static/` ships
every asset (uPlot for the charts, our script and stylesheet): nothing comes from the network. docs/dashboard.md."""
