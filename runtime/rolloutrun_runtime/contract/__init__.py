"""The contract: every fact the operator and the runtime (and a Gym and its trainer) must agree on.

Both sides import these modules and nothing else of each other, so a name, a path, a port or
a wire format is spelled once and a change to it is seen by every reader at once:

- :mod:`.run_config` -- the ``RunConfig`` the CRD embeds as ``spec.run`` (the pod contract's
  body; ``spec.run`` itself is its ``RunSettings``, less what the operator derives) and the
  exit codes a trainer reports to the operator;
- :mod:`.field_rules` -- rules across fields, as CEL for the CRD and one message for both
  the API server and the validators;
- :mod:`.pod` -- what the operator puts on a pod and the runtime reads back: environment
  variable names, annotations, mount paths, ports, Lease names and holder identities;
- :mod:`.wire` -- the request and response models of the HTTP APIs between pods (a Gym's
  ``/run``, its episodes API and checkpoint control plane, the generation API);
- :mod:`.layout` -- the storage layout: every file and directory name and schema version of
  trainer checkpoints, rollout snapshots, manifests and the Gym audit.

Everything here imports only pydantic and the standard library: the operator image has no
torch, and the contract must be cheap to import from any process.
"""
