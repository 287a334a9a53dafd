"""rolloutrun's Kubernetes operator: the RolloutRun API, reconciliation and the local cluster.

The operator never imports torch, ray or google.cloud, and reaches the runtime only through
:mod:`rolloutrun_runtime.contract.run_config` (the pod contract the CRD embeds).
"""

__version__ = "0.1.0"
