"""Runs on every node with the standard library + accelerate (+ PyYAML) only, so it can be shipped to a host that lacks orchestrate: agent, probe, rank watch, run dir, heartbeats, process tools."""
