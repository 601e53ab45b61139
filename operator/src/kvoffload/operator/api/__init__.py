"""The Kubernetes API as the operator uses it: a small REST client, Events, retries, pod owners."""
