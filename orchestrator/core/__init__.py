"""PURE: spec, schema, plan, jobplan, render, hostlist, health rules, model shapes, accelerate config text.

No I/O, no subprocess, no environment reads; imports nothing with side effects (import-linter keeps it so)."""
