"""Random-weight Llama checkpoints of real models' attention shapes (``random_models.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from random_models import LLAMA2_13B_ATTENTION, LLAMA3_70B_ATTENTION, save_random_llama


@pytest.fixture(scope="session")
def llama2_13b_attention_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama2-13b-attn")
    return save_random_llama(folder, seed=13, **LLAMA2_13B_ATTENTION)


@pytest.fixture(scope="session")
def llama3_70b_attention_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama3-70b-attn")
    return save_random_llama(folder, seed=70, **LLAMA3_70B_ATTENTION)
