"""What identifies a model's and an adapter's weights in keys (``kvoffload.connector.identities``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvoffload.connector.identities import (
    WHOLE_FILE_BYTES,
    AdapterIdentities,
    CheckpointDigests,
    model_identity,
    prompt_table_digest,
    sample_offsets,
)

pytestmark = pytest.mark.connector


def checkpoint(root: Path, weights: bytes, config: str = '{"hidden_size": 64}') -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(config)
    (root / "model.safetensors").write_bytes(weights)
    return root


WEIGHTS = bytes(range(256)) * (4 * WHOLE_FILE_BYTES // 256)
"""4 MiB: above the whole-file size, so it is sampled."""


def test_the_same_weights_at_two_paths_are_one_identity(tmp_path: Path) -> None:
    digests = CheckpointDigests()
    assert digests.digest(str(checkpoint(tmp_path / "a", WEIGHTS))) == digests.digest(
        str(checkpoint(tmp_path / "b", WEIGHTS))
    )


@pytest.mark.parametrize("offset", [0, sample_offsets(len(WEIGHTS))[7] + 5, len(WEIGHTS) - 1])
def test_weights_that_differ_at_a_sampled_offset_are_another_identity(tmp_path: Path, offset: int) -> None:
    changed = bytearray(WEIGHTS)
    changed[offset] ^= 0xFF
    digests = CheckpointDigests()
    assert digests.digest(str(checkpoint(tmp_path / "a", WEIGHTS))) != digests.digest(
        str(checkpoint(tmp_path / "b", bytes(changed)))
    )


def test_another_config_is_another_identity(tmp_path: Path) -> None:
    digests = CheckpointDigests()
    assert digests.digest(str(checkpoint(tmp_path / "a", WEIGHTS))) != digests.digest(
        str(checkpoint(tmp_path / "b", WEIGHTS, config='{"hidden_size": 128}'))
    )


def test_a_checkpoint_rewritten_in_place_is_digested_again(tmp_path: Path) -> None:
    digests = CheckpointDigests()
    root = checkpoint(tmp_path / "m", WEIGHTS)
    before = digests.digest(str(root))
    (root / "model.safetensors").write_bytes(WEIGHTS[::-1])
    os.utime(root / "model.safetensors", ns=(1, 1))  # a new time, whatever the clock's resolution
    assert digests.digest(str(root)) != before


def test_a_model_is_identified_by_its_checkpoint_else_its_pinned_revision_else_its_name(tmp_path: Path) -> None:
    root = checkpoint(tmp_path / "m", WEIGHTS)
    assert model_identity(str(root)).startswith("w")
    assert model_identity("org/model", "0123abc") == "r0123abc"
    assert model_identity("org/model") == ""


@dataclass
class LoraRequest:
    lora_task_id: int | None = None
    py_lora_path: str | None = None
    lora_weights: Any = None
    lora_config: Any = None


def test_an_adapter_is_identified_by_its_checkpoint_not_its_task_id(tmp_path: Path) -> None:
    a = checkpoint(tmp_path / "a", WEIGHTS)
    b = checkpoint(tmp_path / "b", WEIGHTS[::-1])
    adapters = AdapterIdentities(CheckpointDigests())
    same_id_other_adapter = adapters.of(LoraRequest(1, str(a))), adapters.of(LoraRequest(1, str(b)))
    assert None not in same_id_other_adapter and same_id_other_adapter[0] != same_id_other_adapter[1]
    assert adapters.of(LoraRequest(1, str(a))) == adapters.of(LoraRequest(2, str(checkpoint(tmp_path / "c", WEIGHTS))))


def test_an_adapter_carried_as_tensors_is_remembered_for_requests_carrying_only_its_id() -> None:
    adapters = AdapterIdentities(CheckpointDigests())
    assert adapters.of(LoraRequest(5)) is None, "an adapter known by nothing must not be cached"
    carried = adapters.of(LoraRequest(5, lora_weights=torch.ones(2, 4), lora_config=torch.tensor([[0, 1, 8]])))
    assert carried and adapters.of(LoraRequest(5)) == carried
    other = adapters.of(LoraRequest(6, lora_weights=torch.zeros(2, 4), lora_config=torch.tensor([[0, 1, 8]])))
    assert other != carried


def test_no_adapter_and_an_unreadable_adapter(tmp_path: Path) -> None:
    adapters = AdapterIdentities(CheckpointDigests())
    assert adapters.of(LoraRequest()) == b""
    assert adapters.of(LoraRequest(1, str(tmp_path / "missing"))) is None


@dataclass
class TunedRequest:
    prompt_embedding_table: Any = None


def test_a_prompt_table_is_identified_by_its_values() -> None:
    one = prompt_table_digest(TunedRequest(torch.ones(4, 8, dtype=torch.bfloat16)))
    assert one == prompt_table_digest(TunedRequest(torch.ones(4, 8, dtype=torch.bfloat16)))
    assert one != prompt_table_digest(TunedRequest(torch.full((4, 8), 2.0, dtype=torch.bfloat16)))
    assert prompt_table_digest(TunedRequest()) == b""
