"""Communicators that need no GPU: `LocalComm` (one rank) and `MockComm` (N ranks of the mock
backend over Unix sockets), with `run_ranks` to drive N mock ranks from a test. NCCL's is in
`atlas.adapters.nccl`."""
