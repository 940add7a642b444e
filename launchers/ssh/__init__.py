"""SSH backend (paramiko): launcher, a running job's per-node I/O, the remote argv/teardown programs, the transport."""
