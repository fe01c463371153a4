"""SIGTERM / SIGINT to a launcher we own (nd_parallel.fault.launch.launch, behind `nd-parallel demo|train` and the
benchmarks) ends torchrun, both ranks and their dataloader workers within 30 s, leaving no process behind; with
save_on_signal the ranks first write a preemption checkpoint after the same optimizer step."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nd_parallel.fault.proctree import alive, descendants
from tests.distributed.test_fault_hang import events

DRIVER = ("import sys; from nd_parallel.fault.launch import launch; "
          "launch('tests/distributed/fault_worker.py', 2, sys.argv[1:], timeout=300)")


def start_and_signal(sig, model, out, options):
    # SIGINT at its default in the driver: a suite started in the background by a non-interactive shell inherits it
    # ignored (POSIX), and Python then raises no KeyboardInterrupt, as a terminal's Ctrl-C would
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, "spin", model, str(out), json.dumps(options)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 150
    while time.time() < deadline:  # both ranks are stepping (their dataloader workers are up)
        if {e["rank"] for e in events(out) if e["event"] == "step"} == {0, 1}:
            break
        assert driver.poll() is None, driver.communicate()[0][-3000:]
        time.sleep(0.5)
    tree = descendants(driver.pid)
    time.sleep(1.0)
    tree |= descendants(driver.pid)
    sent = time.time()
    driver.send_signal(sig)
    while (alive(driver.pid) and driver.poll() is None) or any(alive(p) for p in tree):
        assert time.time() - sent < 60, [p for p in tree if alive(p)]
        time.sleep(0.1)
    took = time.time() - sent
    text = driver.communicate()[0]
    return driver.returncode, took, tree, text


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_signal_to_launcher_leaves_no_process(sig, tiny_models, tmp_path):
    code, took, tree, text = start_and_signal(sig, tiny_models["llama"], tmp_path,
                                              {"workers": 2, "hang_timeout": 0, "step_sleep": 0.05})
    # driver's torchrun, 2 ranks, 2 dataloader workers each (and any helper they started)
    assert len(tree) >= 5, tree
    print(f"{signal.Signals(sig).name}: {len(tree)} processes under the launcher gone {took:.1f} s after the signal")
    assert took < 30
    assert code != 0, text[-2000:]
    assert not [p for p in tree if alive(p)]


def test_save_on_signal_writes_a_preemption_checkpoint(tiny_models, tmp_path):
    code, took, tree, text = start_and_signal(signal.SIGTERM, tiny_models["llama"], tmp_path,
                                              {"workers": 2, "layout": {"save_on_signal": True}, "step_sleep": 0.05})
    print(f"save_on_signal: checkpoint written and {len(tree)} processes gone {took:.1f} s after SIGTERM")
    assert took < 30 and code != 0
    preempted = [e for e in events(tmp_path) if e["event"] == "preempted"]
    assert sorted(e["rank"] for e in preempted) == [0, 1], text[-3000:]
    assert len({e["step"] for e in preempted}) == 1  # both ranks stopped after the same optimizer step
    marker = json.loads((tmp_path / "preempted" / "nd_parallel.json").read_text())
    assert marker["optimizer_step"] == preempted[0]["step"]
    assert not [p for p in tree if alive(p)]
    assert os.path.isdir(tmp_path / "preempted" / "dcp")
