"""The cache-server container: validated configuration, the supervised LMCache MP server, health and metrics."""
