"""Experience bookkeeping that outlives a process: the rollout recovery ledger."""
