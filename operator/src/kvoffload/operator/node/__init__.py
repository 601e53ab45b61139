"""Node-shared mode: the cache pod plan per node (pure), whether a pod fits, and the effects that keep cache pods."""
