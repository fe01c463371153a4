"""The chaos harness: `nd-parallel train --max-restarts N` under injected faults, timed, and compared bit for bit with
the same run left alone.

Faults, one at a time, each at a chosen (or random) step; every one must cost one restart and be reported:

=========  =======================================================  ==========================================
kind       what happens                                             how it is detected (what ``detected_s`` is)
=========  =======================================================  ==========================================
kill       SIGKILL of one rank                                      every other rank gone (torchrun's agent)
save       a rank dies in the middle of writing a checkpoint        every other rank gone; resume takes the
           (chaos_inject.py: its shards written, no marker)         checkpoint before
stop       SIGSTOP of one rank                                      the hang line of a live rank (watchdog.py)
nan        NaN in one rank's forward for one step (chaos_inject)    the "non-finite values" error
mismatch   one rank's model config differs when the next attempt    the agreement error at prepare
           starts (chaos_inject; armed with the fault before it)
node       SIGKILL of one node's torchrun agent (nnodes > 1); its   every rank gone, the killed agent's too
           ranks must follow; a fresh `nd-parallel train` then
           takes the node's place
end        a rank dies after the last step's checkpoint (last       every other rank gone; the restart trains
           fault only; chaos_inject)                                no further
=========  =======================================================  ==========================================

For each fault the harness records ``detected_s`` (fault to detection), ``restart_to_first_step_s`` (fault to the
first step the next attempt logs) and ``steps_lost`` (the restarted run's own account, fault/resume.py). The node
serving the rendezvous (node 0, told so with ``is_host``) is never the one killed: torch's c10d rendezvous cannot
outlive it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from nd_parallel.fault.proctree import alive, descendants, kill_all

from .chaos_inject import ARMED, EVENTS

KINDS = ("kill", "save", "stop", "nan", "mismatch", "node", "end")
_NOTE = re.compile(r"\(step (\d+)\).*?(\d+) steps lost")  # fault/resume.account's line
_FROM = re.compile(r"resuming from (checkpoint-\d+)")
_REPORT = {"stop": "[nd_parallel] hang:", "nan": "non-finite values at optimizer step",
           "mismatch": "ranks disagree on the model config"}


class ChaosError(RuntimeError):
    """The run did not recover as it must (a wait ran out, a process failed): the message ends with its output."""


@dataclass
class Fault:
    kind: str
    step: int = 1  # strikes once the run has logged this step (nan / save: the first such step / save from it on)
    rank: int | None = None  # the victim (node: the node index); None: chosen by the harness's seeded generator


@dataclass
class Measured:
    kind: str
    step: int  # the last step logged when it struck
    victim: int
    detected_s: float
    restart_to_first_step_s: float
    steps_lost: int
    resumed_from: str | None
    resumed_step: int
    report: str  # the line that reported it


@dataclass
class ChaosResult:
    measured: list[Measured]
    log: list[dict]  # the run's train_log.jsonl
    output: str
    seconds: float

    def table(self) -> str:
        rows = [f"{'fault':9} {'step':>5} {'victim':>6} {'detected':>9} {'restart->step':>14} {'lost':>5}  report"]
        rows += [f"{m.kind:9} {m.step:5d} {m.victim:6d} {m.detected_s:8.2f}s {m.restart_to_first_step_s:13.2f}s "
                 f"{m.steps_lost:5d}  {m.report[:90]}" for m in self.measured]
        return "\n".join(rows)


class _Node:
    """One `nd-parallel train` process (a node) and the lines it prints, each with the time it arrived."""

    def __init__(self, cmd: list[str], env: dict, echo=None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.killed = False
        self._echo = echo
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            if self._echo:
                self._echo(line.rstrip("\n"))

    def _processes(self, name: str):
        """(pid, argv, environment) of every live descendant of this node whose command line has ``name``."""
        for pid in descendants(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            if any(a == name or a.endswith(b"/" + name) for a in argv) and alive(pid):
                yield pid, argv, env

    def ranks(self) -> dict[int, int]:
        """Global rank -> pid of this node's live rank processes."""
        found = {}
        for pid, argv, env in self._processes(b"nd_parallel.cli.train.rank"):  # `python -u -m <the rank program>`
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None and b"torch.distributed.run" not in argv:
                found[rank] = pid
        return found

    def kill(self) -> None:
        """Every process of this node at once."""
        kill_all({self.proc.pid, *descendants(self.proc.pid)})

    def kill_agent(self) -> int:
        """A node failure as issue 13 states it: SIGKILL of the node's torchrun agent (its ranks must follow)."""
        for pid, _, _ in self._processes(b"torch.distributed.run"):
            os.kill(pid, signal.SIGKILL)
            return pid
        raise ChaosError(f"no torchrun agent under node process {self.proc.pid}")

    def finish(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = self.proc.wait()
        self._reader.join(timeout=10)
        return rc


class ChaosRun:
    """One YAML, trained with `nd-parallel train` on ``nproc`` ranks over ``nnodes`` local "nodes"."""

    def __init__(self, yaml: dict, workdir, *, nproc: int, nnodes: int = 1, hang_timeout: float = 10,
                 seed: int = 0, wait_s: float = 300, echo=None):
        import random

        self.yaml, self.workdir = dict(yaml), Path(workdir)
        self.nproc, self.nnodes, self.hang_timeout = nproc, nnodes, hang_timeout
        self.rng, self.wait_s, self.echo = random.Random(seed), wait_s, echo
        self.ctl = self.workdir / "chaos-ctl"
        self.nodes: list[_Node] = []

    # ------------------------------------------------------------------------------------------ launching
    def _write_yaml(self, name: str, faults: bool) -> tuple[Path, Path]:
        out = self.workdir / name
        cfg = {**self.yaml, "output_dir": str(out), "resume_from_checkpoint": "auto"}
        if faults:
            cfg.update(hang_timeout=self.hang_timeout, trainer_callbacks=[
                {"class": "nd_parallel.testing.chaos_inject:ChaosInjector", "args": {"dir": str(self.ctl)}}])
        path = self.workdir / f"{name}.yml"
        path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
        return path, out

    def _command(self, cfg: Path, max_restarts: int, nnodes: int, host: bool) -> list[str]:
        cmd = [sys.executable, "-m", "nd_parallel.cli", "train", str(cfg), "--nproc", str(self.nproc),
               "--max-restarts", str(max_restarts)]
        if nnodes > 1:  # a dead node is noticed by the rendezvous after 3 missed 1 s keep-alives
            # is_host: every node here resolves the endpoint to itself, and without it whichever agent binds the port
            # first serves the store; under load that can be node 1, the one the harness kills
            cmd += ["--nnodes", str(nnodes), "--rdzv-endpoint", self._endpoint, "--rdzv-id", "chaos",
                    "--rdzv-conf", f"keep_alive_interval=1,keep_alive_max_attempt=3,is_host={str(host).lower()}"]
        return cmd

    def _start(self, cfg: Path, max_restarts: int, nnodes: int) -> None:
        from nd_parallel.fault.launch import free_port

        if nnodes > 1 and not self.nodes:
            self._endpoint = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for _ in range(nnodes - len([n for n in self.nodes if not n.killed and n.proc.poll() is None])):
            self.nodes.append(_Node(self._command(cfg, max_restarts, nnodes, host=not self.nodes), env, self.echo))

    def _wait_all(self, what: str) -> None:
        failed = [(i, n.finish(self.wait_s)) for i, n in enumerate(self.nodes) if not n.killed]
        if any(rc for _, rc in failed):
            bad = [i for i, rc in failed if rc]
            raise ChaosError(f"{what}: node(s) {bad} exited non-zero\n{self.output()[-6000:]}")

    def reference(self, name: str = "uninterrupted", nnodes: int | None = None) -> Path:
        """The run left alone (same YAML, no faults); returns its output_dir."""
        cfg, out = self._write_yaml(name, faults=False)
        self.nodes = []
        self._start(cfg, 0, self.nnodes if nnodes is None else nnodes)
        self._wait_all("the uninterrupted run")
        return out

    # ------------------------------------------------------------------------------------------ watching
    def output(self) -> str:
        lines = sorted(line for n in self.nodes for line in n.lines)
        return "\n".join(text for _, text in lines)

    def _lines_after(self, t: float) -> list[tuple[float, str]]:
        return sorted(line for n in self.nodes for line in n.lines if line[0] >= t)

    def _wait(self, what: str, ready, poll: float = 0.02):
        deadline = time.time() + self.wait_s
        while True:
            value = ready()
            if value:
                return value
            ended = not any(n.proc.poll() is None for n in self.nodes)
            if ended or time.time() > deadline:
                why = "the run ended" if ended else f"{self.wait_s:.0f} s passed"
                raise ChaosError(f"{why} while waiting for {what}\n{self.output()[-6000:]}")
            time.sleep(poll)

    def _last_step(self) -> int:
        try:
            lines = self._log.read_text(encoding="utf-8").splitlines()
            return json.loads(lines[-1])["step"] if lines else 0
        except (OSError, ValueError, KeyError, IndexError):  # not there yet, or being cut back
            return 0

    def _ranks(self) -> dict[int, tuple[int, int]]:
        """Global rank -> (node index, pid) of every live rank."""
        return {r: (i, pid) for i, n in enumerate(self.nodes) for r, pid in n.ranks().items()}

    def _events(self) -> dict[int, dict]:
        try:
            text = (self.ctl / EVENTS).read_text(encoding="utf-8")
        except OSError:
            return {}
        return {e["id"]: e for e in map(json.loads, text.splitlines())}

    def _arm(self, fault_id: int, kind: str, rank: int, step: int) -> None:
        tmp = self.ctl / f".armed-{fault_id}.tmp"
        tmp.write_text(json.dumps({"id": fault_id, "kind": kind, "rank": rank, "step": step}))
        os.replace(tmp, self.ctl / ARMED.format(fault_id))  # the ranks never read half a file

    def _line(self, t: float, needle: str) -> tuple[float, str] | None:
        """The first line printed since ``t`` that holds ``needle``, from the needle on (a progress bar may share
        the line), with the time it arrived."""
        found = next((line for line in self._lines_after(t) if needle in line[1]), None)
        return found and (found[0], found[1][found[1].index(needle):])

    # ------------------------------------------------------------------------------------------ the run
    def run(self, faults: list[Fault], name: str = "chaos") -> ChaosResult:
        """Train under ``faults`` (in order) and measure each; raises ChaosError if the run does not recover."""
        bad = [f.kind for f in faults if f.kind not in KINDS or (f.kind == "node" and self.nnodes < 2)]
        if bad:
            raise ValueError(f"faults {bad}: use {', '.join(KINDS)} ('node' needs nnodes >= 2)")
        if any(f.kind == "end" for f in faults[:-1]):
            raise ValueError("'end' strikes after the last step: it can only be the last fault")
        if any(a.kind == b.kind == "mismatch" for a, b in zip(faults, faults[1:])):
            raise ValueError("two mismatches in a row: a mismatch strikes when the attempt after the previous fault "
                             "starts, so put another fault between them")
        shutil.rmtree(self.ctl, ignore_errors=True)  # a fault armed or fired by an earlier run must not count
        self.ctl.mkdir(parents=True)
        cfg, out = self._write_yaml(name, faults=True)
        self._log = out / "train_log.jsonl"
        self.nodes, measured, start = [], [], time.time()
        if faults and faults[0].kind == "mismatch":
            self._arm(0, "mismatch", self._victim(faults[0]), 0)
        self._max_restarts = len(faults)
        self._start(cfg, self._max_restarts, self.nnodes)
        resumed = 0
        for i, fault in enumerate(faults):
            if fault.kind == "mismatch":
                measured.append(self._measure_mismatch(i))
                resumed = max(resumed, self._last_step())
                continue
            self._wait(f"step {max(fault.step, resumed + 1)} before fault {i} ({fault.kind})",
                       lambda s=max(fault.step, resumed + 1): self._last_step() >= s)
            follows = i + 1 < len(faults) and faults[i + 1].kind == "mismatch"
            if follows:  # it strikes when the attempt after this fault starts
                self._arm(i + 1, "mismatch", self._victim(faults[i + 1]), 0)
            m = self._inject(i, fault, cfg)
            measured.append(m)
            resumed = m.resumed_step
        self._wait_all(f"the run after {len(faults)} fault(s)")
        log = [json.loads(line) for line in self._log.read_text(encoding="utf-8").splitlines()]
        return ChaosResult(measured, log, self.output(), time.time() - start)

    def _victim(self, fault: Fault) -> int:
        if fault.rank is not None:
            return fault.rank
        if fault.kind == "node":
            return self.rng.randrange(1, self.nnodes)
        return self.rng.randrange(self.nproc)

    def _inject(self, i: int, fault: Fault, cfg: Path) -> Measured:
        victim = self._victim(fault)
        before = self._ranks()
        step = self._last_step()
        if fault.kind in ("nan", "save", "end"):
            every = float(self.yaml.get("save_steps", 1))
            at = {"nan": step + 2, "save": int((step // every + 1) * every), "end": 0}[fault.kind]
            self._arm(i, fault.kind, victim, max(at, fault.step))
            event = self._wait(f"fault {i} ({fault.kind}) to fire on rank {victim}", lambda: self._events().get(i))
            t0, step = event["t"], event["step"]
        else:
            t0 = time.time()
            if fault.kind == "node":  # victim: the index among the live nodes (0 serves the rendezvous)
                node = [n for n in self.nodes if not n.killed][victim]
                node.killed = True
                node.kill_agent()
            else:
                os.kill(before[victim][1], signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        if fault.kind in _REPORT:
            t_detect, report = self._wait(f"the report of fault {i} ({fault.kind})",
                                          lambda: self._line(t0, _REPORT[fault.kind]))
        # every rank of the attempt, the killed node's included (none may outlive its agent), but for a stopped or
        # killed victim rank
        others = [pid for r, (_, pid) in before.items() if r != victim or fault.kind == "node"]
        t_gone = self._wait(f"every rank to stop after fault {i} ({fault.kind})",
                            lambda: not any(alive(p) for p in others) and time.time())
        if fault.kind not in _REPORT:
            t_detect, report = t_gone, f"every other rank stopped {t_gone - t0:.2f} s after the {fault.kind}"
            # how they learnt it: a failed collective (a peer's sockets closed) or, where they waited on nothing
            # that fails (the store), the hang watchdog, whose report then names the wait
            hang = self._line(t0, "[nd_parallel] hang:") or self._line(t0, "[nd_parallel] hang reported by")
            if hang and hang[0] <= t_gone:
                report += f"; the hang watchdog told them: {hang[1]}"
        if fault.kind == "node":
            self._start(cfg, self._max_restarts, self.nnodes)  # the replacement node, as a scheduler starts it
        source, resumed_step, lost, t_step = self._restarted(i, t_gone)
        return Measured(fault.kind, step, victim, round(t_detect - t0, 2), round(t_step - t0, 2), lost, source,
                        resumed_step, report)

    def _restarted(self, i: int, after: float) -> tuple[str | None, int, int, float]:
        """(checkpoint, its step, steps lost, when the first new step was logged) of the restart after fault i."""
        t_note, note = self._wait(f"the restart after fault {i}", lambda: self._line(after, "[nd_parallel] restart"))
        step, lost = map(int, _NOTE.search(note).groups())
        source = _FROM.search(note)
        if step >= int(self.yaml.get("max_steps") or 0) > 0:  # resumed at the end: it must train no further
            t_step, _ = self._wait(f"the finished run's restart after fault {i} to stop",
                                   lambda: self._line(t_note, "is the run's last step: nothing left to train"))
        else:  # the note is printed after the log was cut back to `step`: a line beyond it is the new attempt's
            t_step = self._wait(f"the first step after the restart of fault {i}",
                                lambda: self._last_step() > step and time.time())
        return source.group(1) if source else None, step, lost, t_step

    def _measure_mismatch(self, i: int) -> Measured:
        event = self._wait(f"the mismatch (fault {i}) to strike", lambda: self._events().get(i))
        t_detect, report = self._wait(f"the agreement error of fault {i}",
                                      lambda: self._line(event["t"], _REPORT["mismatch"]))
        source, resumed_step, _, t_step = self._restarted(i, t_detect)
        return Measured("mismatch", event["step"], event["rank"], round(t_detect - event["t"], 2),
                        round(t_step - event["t"], 2), 0, source, resumed_step, report)


def random_faults(rng, count: int, steps: int, kinds=("kill", "save", "stop", "nan", "mismatch")) -> list[Fault]:
    """``count`` faults of ``kinds`` at random steps spread over ``steps`` (each kind about as often; never two
    mismatches in a row), the victims left to the harness's generator."""
    drawn = [kinds[i % len(kinds)] for i in range(count)]
    for _ in range(1000):  # a shuffle with no two mismatches in a row (most are; always possible below 1/2)
        rng.shuffle(drawn)
        if not any(a == b == "mismatch" for a, b in zip(drawn, drawn[1:])):
            break
    at = sorted(rng.sample(range(2, max(3, steps - 2)), count))
    return [Fault(kind, step) for kind, step in zip(drawn, at)]


def to_json(result: ChaosResult) -> dict:
    return {"measured": [asdict(m) for m in result.measured], "seconds": round(result.seconds, 1)}
