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


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group for the test, destroyed after it (later tests check that none is left)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def pytest_terminal_summary(terminalreporter):
    """Every skip and its reason, also under `pytest -q` (which lists none by itself): a skipped feature test must
    never pass unnoticed."""
    reasons = sorted({str(r.longrepr[2]) if isinstance(r.longrepr, tuple) else str(r.longrepr)
                      for r in terminalreporter.stats.get("skipped", [])})
    if reasons:
        terminalreporter.write_sep("-", "skipped, and why")
        for reason in reasons:
            terminalreporter.write_line(reason)
