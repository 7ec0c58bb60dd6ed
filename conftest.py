"""Shared pytest fixtures (pytest loads this file for every test module, in script mode too)."""

import pytest


@pytest.fixture(autouse=True)
def _restore_hugging_face_rope():
    """The rope kernel swaps a module-level function of transformers; undo it after each test."""
    from model_families import SUPPORTED_MODEL_TYPES, family_module

    saved = {f: family_module(f).apply_rotary_pos_emb for f in SUPPORTED_MODEL_TYPES}
    yield
    for f, fn in saved.items():
        family_module(f).apply_rotary_pos_emb = fn
