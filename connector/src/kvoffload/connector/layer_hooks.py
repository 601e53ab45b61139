"""Which layers of a forward pass waited for their KV: what makes layer-wise loads safe.

TensorRT-LLM calls ``wait_for_layer_load(layer_idx)`` before each decoder layer's work is queued (a
forward pre-hook on every ``DecoderLayer``). A layer-wise load relies on that call for every layer
that reads the loaded blocks: one that runs without it reads KV that may not have landed. So loads
go layer-wise only once this engine was seen calling the hook for every layer of the pool, in order,
within one forward pass; and a forward with a layer-wise load in which a layer went without it is
reported (the batch must fail), after which loads are copied whole again.
"""

from __future__ import annotations


class LayerHooks:
    """The hook calls of the current forward pass, and whether every layer's has been seen."""

    def __init__(self, num_layers: int) -> None:
        self._num_layers = num_layers
        self._waited: list[int] = []
        self.seen_every_layer = False
        """A forward pass called the hook for layers ``0 .. num_layers - 1``, in that order."""
        self.broken = False
        """A forward pass with a layer-wise load ran a layer without its hook: whole copies from now on."""

    @property
    def layerwise_ready(self) -> bool:
        """Whether the next load may go layer-wise."""
        return self.seen_every_layer and not self.broken

    def forward_started(self) -> None:
        self._waited = []

    def waited(self, layer: int) -> None:
        self._waited.append(layer)

    def forward_ended(self, had_layerwise_load: bool) -> list[int]:
        """The forward pass is queued: the pool's layers it never waited for (empty: every one was).
        With a layer-wise load in it, any such layer marks the hooks broken."""
        if self._waited == list(range(self._num_layers)):
            self.seen_every_layer = True
        missing = sorted(set(range(self._num_layers)) - set(self._waited))
        if had_layerwise_load and missing:
            self.broken = True
        self._waited = []
        return missing
