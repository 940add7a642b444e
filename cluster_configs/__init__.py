"""Data, not code: the cluster files and `profiles/<name>.yaml` (the accelerate profiles under TRL's names). A package
only so that they ship in the wheel; orchestrator.resources finds them."""
