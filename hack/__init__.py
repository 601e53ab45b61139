"""Developer tooling: setup, the local control plane, the bundle recipe, the demo and its workloads."""
