import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub: models are built from configs


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> directory of a tiny randomly initialised checkpoint (built once per session)."""
    from nd_parallel.testing.models import FAMILIES, save_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {family: str(save_tiny_model(family, root / family)) for family in FAMILIES}
