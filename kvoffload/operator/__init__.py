"""The kopf operator: opt-in by annotation, policy from KVCachePolicy, pure decisions, thin effects."""
