"""Admission mode: the pure admission decisions, the webhook server and its TLS, and the catch-up of uninjected pods."""
