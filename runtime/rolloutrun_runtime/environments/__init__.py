"""Environments the policy acts in: the Gym-style HTTP servers and (later) their checkpointing."""
