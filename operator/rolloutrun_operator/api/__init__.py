"""The RolloutRun API (v1alpha1) and the generator of its CRD."""
