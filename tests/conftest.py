"""Shared fixtures: the shipped family and its tokenizer (loaded once per module that asks)."""
from __future__ import annotations

import pytest

from orchestrator.core.family import load_family
from orchestrator.serve.tokenizer import FamilyTokenizer
from tests.fakes_serving import family_dir

FAMILY_DIR = family_dir()


@pytest.fixture(scope="module")
def family():
    return load_family(FAMILY_DIR)


@pytest.fixture(scope="module")
def tokenizer():
    return FamilyTokenizer(FAMILY_DIR / "tiny-s")
