"""Stand-in for ``tensorrt_llm.bindings.internal.batch_manager``: the names connectors import
(LMCache's own TensorRT-LLM adapter imports ``LlmRequest`` for its type hints)."""

from __future__ import annotations


class LlmRequest:
    """The C++ base request as a connector sees it at lookup: an id, the tokens, ``cache_salt_id``."""

    def __init__(self, request_id: int, tokens: list[int], cache_salt_id: int | None = None) -> None:
        self.request_id = request_id
        self.py_request_id = request_id
        self.cache_salt_id = cache_salt_id
        self._tokens = list(tokens)

    def get_tokens(self, beam: int = 0) -> list[int]:
        return self._tokens
