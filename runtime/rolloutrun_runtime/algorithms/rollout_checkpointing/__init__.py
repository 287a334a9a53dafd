"""Rollout checkpointing: the state both halves (snapshots, restore) share with the controller.

``state.py`` holds the parts the controller builds once and hands to both halves. The
snapshot half (``snapshots.py``, its pure rules in ``snapshots_decisions.py``) and the restore
half (``restore.py``, its reading steps in ``restore_assembly.py``) never import each other
and reach the controller only through ``RolloutParts``. Both use ``manifest.py`` (the
snapshot store; the manifest's format in ``manifest_format.py``), ``inventory.py`` and
``trace.py``. Every file name and schema version they write or read is spelled in
:mod:`rolloutrun_runtime.contract.layout`.
"""
