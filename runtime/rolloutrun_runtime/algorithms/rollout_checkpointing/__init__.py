"""Rollout checkpointing: the state both halves (snapshots, restore) share with the controller.

``state.py`` holds the parts the controller builds once and hands to both halves. The
snapshot half (``snapshots.py``) and the restore half (``restore.py``) never import each
other and reach the controller only through ``RolloutParts``.
"""
