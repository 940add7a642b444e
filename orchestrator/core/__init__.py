"""PURE: spec, schema, plan, jobplan, render, hostlist, health rules. No I/O, no subprocess, no env reads; imports nothing with side effects."""
