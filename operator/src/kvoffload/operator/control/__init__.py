"""The control loop: kopf handlers, the reconciler, policy status, locked writes and leader election."""
