"""Several nodes resume from one checkpoint or stop together (fault/resume.agreed), on 2 gloo ranks: rank 1 plays a
replacement node whose agent counts attempts from 0 while rank 0's is at 1; with resume_from_checkpoint unset both
must still take the latest checkpoint. When the ranks see different checkpoints (a file system that lags on one
node) every rank stops with the checkpoint each one would have taken."""

import json

import pytest

from nd_parallel.fault.launch import launch


def _checkpoint(root, step):
    d = root / f"checkpoint-{step}"
    (d / "nd_parallel").mkdir(parents=True)
    (d / "nd_parallel" / "nd_parallel.json").write_text("{}")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": 10}))


@pytest.mark.parametrize("mode", ["shared", "lagging"])
def test_ranks_agree_on_the_checkpoint_to_resume(tmp_path, mode):
    _checkpoint(tmp_path / "shared", 4)
    _checkpoint(tmp_path / "rank0", 4)
    _checkpoint(tmp_path / "rank1", 2)  # rank 1's view lags one checkpoint behind
    launch("tests/distributed/resume_worker.py", 2, [str(tmp_path), mode], timeout=120)
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    if mode == "shared":
        assert [r["choice"] for r in results] == [[str(tmp_path / "shared" / "checkpoint-4"), 1]] * 2
    else:
        for r in results:
            assert r["error"].startswith(f"ranks would resume from different checkpoints: ranks 0: "
                                         f"{tmp_path / 'rank0' / 'checkpoint-4'}; ranks 1: "
                                         f"{tmp_path / 'rank1' / 'checkpoint-2'}"), r
