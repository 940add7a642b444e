"""The face: argv parsing, views, terminal rendering, progress, log tails, plots. Parse -> api call -> print."""
