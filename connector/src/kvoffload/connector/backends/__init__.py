"""Where the connector keeps KV outside the engine: the pod's cache server or an in-process LMCache."""
