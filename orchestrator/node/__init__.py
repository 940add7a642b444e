"""What runs on every node: the agent, its probe and operations, rank watch, the run dir, heartbeat reading,
process tools and the ranks' zero-code hooks. Standard library + accelerate (+ PyYAML) only, so it can be shipped
to a host that lacks orchestrate (import-linter keeps it so)."""
