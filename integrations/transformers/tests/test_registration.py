"""Registration of ``"groupgrad"`` in transformers' experts registry, and the version gate."""

from __future__ import annotations

import re

import pytest
import transformers
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

import groupgrad.integrations.transformers as ggt


def test_import_registers_groupgrad() -> None:
    assert ALL_EXPERTS_FUNCTIONS["groupgrad"] is ggt.groupgrad_experts_forward
    assert "groupgrad" in ALL_EXPERTS_FUNCTIONS.valid_keys()
    assert ggt.IMPLEMENTATION == "groupgrad"


def test_register_is_idempotent() -> None:
    before = dict(ExpertsInterface._global_mapping)
    ggt.register()
    ggt.register()
    assert dict(ExpertsInterface._global_mapping) == before


def test_a_foreign_groupgrad_entry_is_not_overwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    def impostor(*args: object) -> None:
        return None

    monkeypatch.setitem(ExpertsInterface._global_mapping, "groupgrad", impostor)
    with pytest.raises(RuntimeError, match=r"registered already as .*impostor"):
        ggt.register()
    assert ExpertsInterface._global_mapping["groupgrad"] is impostor


@pytest.mark.parametrize("version", ["5.17.0", "5.20.1", "5.24.0", transformers.__version__])
def test_supported_versions_pass(version: str) -> None:
    ggt.check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.16.2", "4.57.0", "5.25.0", "5.25.0.dev0", "6.0.0"])
def test_other_versions_fail_with_the_range(version: str) -> None:
    with pytest.raises(RuntimeError, match=f"transformers {re.escape(version)} is installed"):
        ggt.check_transformers_version(version)
