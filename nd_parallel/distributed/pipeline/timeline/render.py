"""A recorded timeline as files: a Chrome trace (open in https://ui.perfetto.dev) and the textbook picture.

Apart from the analysis because matplotlib is optional: without it, the trace and the numbers still work.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .analysis import bubble, stage_seconds, summarize
from .events import KINDS, Event

logger = logging.getLogger(__name__)


def chrome_trace(events: list[Event], summary: dict | None = None) -> dict:
    """Chrome trace-event JSON: one process per pp rank, one slice per event ("F3", "B3", "W3")."""
    trace = []
    for rank in sorted({e.rank for e in events}):
        stages = sorted({e.stage for e in events if e.rank == rank})
        trace += [
            {"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"pp rank {rank}"}},
            {"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}},
            {"ph": "M", "pid": rank, "tid": 0, "name": "thread_name",
             "args": {"name": "stage " + ",".join(map(str, stages))}},
        ]
    for e in events:
        trace.append({"ph": "X", "pid": e.rank, "tid": 0, "name": e.name, "cat": e.kind,
                      "ts": round(1e6 * e.start, 3), "dur": round(1e6 * (e.end - e.start), 3),
                      "args": {"stage": e.stage, "microbatch": e.mb}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": summary or {}}


def events_from_trace(trace: dict) -> list[Event]:
    """Read events back from a Chrome trace written by ``chrome_trace``."""
    return [Event(t["pid"], t["args"]["stage"], t["args"]["microbatch"], t["cat"], t["ts"] / 1e6,
                  (t["ts"] + t["dur"]) / 1e6) for t in trace["traceEvents"] if t["ph"] == "X"]


_COLORS = {"F": "#4c78a8", "B": "#59a14f", "W": "#f28e2b"}


def _shade(hex_color: str, chunk: int) -> tuple:
    """Later virtual chunks of a rank in a lighter shade of the same colour."""
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = min(0.45 * chunk, 0.7)
    return tuple(c + (1 - c) * mix for c in rgb)


def _legend(ax, events: list[Event], p: int) -> None:
    from matplotlib.patches import Patch

    kinds = [k for k in KINDS if any(e.kind == k for e in events)]
    names = {"F": "F forward", "B": "B backward", "W": "W weight grad"}
    handles = [Patch(color=_COLORS[k], label=names[k]) for k in kinds]
    if any(e.stage >= p for e in events):
        handles.append(Patch(color=_shade("#888888", 1), label="lighter: the rank's later stage"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 1.0 + 0.9 / (p + 2)), ncol=len(handles),
              frameon=False, fontsize=9)


def plot(events: list[Event], path: str | Path, *, p: int, title: str = "", bubble_note: str = "") -> None:
    """The textbook pipeline picture: one row per rank, a box per F/B/W with its micro-batch number."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("the timeline picture needs matplotlib: pip install 'nd_parallel[bench]'") from e
    b = bubble(events, p)
    end_ms = 1e3 * b.span
    fig, ax = plt.subplots(figsize=(14, 0.62 * p + 1.6), dpi=120)
    for e in events:
        x, w = 1e3 * e.start, 1e3 * (e.end - e.start)
        color = _shade(_COLORS[e.kind], e.stage // p)
        ax.broken_barh([(x, w)], (e.rank - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.6)
        label = str(e.mb)
        if w > end_ms * 0.011 * len(label):  # leave the number out of boxes too narrow to hold it
            ax.text(x + w / 2, e.rank, label, ha="center", va="center", fontsize=8, fontweight="bold",
                    color="white" if e.stage < p else "#222222")
    for rank, frac in b.per_rank.items():
        ax.text(end_ms * 1.005, rank, f"idle {100 * frac:.0f}%", va="center", fontsize=8, color="#555555")
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_xlim(0, end_ms * 1.07)
    ax.set_xlabel("time since the first forward (ms)")
    ax.set_facecolor("#f4f4f4")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    _legend(ax, events, p)
    if title or bubble_note:
        ax.set_title("\n".join(t for t in (title, bubble_note) if t), fontsize=10, loc="right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(events: list[Event], out_dir: str | Path, *, schedule: str, p: int, m: int, v: int = 1,
          name: str = "timeline", png: bool = True) -> dict:
    """Write ``name``.json (Chrome trace) and, with matplotlib, ``name``.png; return the bubble summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(events, schedule, p, m, v)
    (out / f"{name}.json").write_text(json.dumps(chrome_trace(events, summary)))
    analytic = summary["bubble_analytical"]
    note = (f"measured bubble {100 * summary['bubble_mean']:.1f}% (mean over ranks), analytical "
            + (f"{100 * analytic:.1f}%" if analytic is not None else "~0 (zero-bubble)"))
    if png:
        try:
            plot(events, out / f"{name}.png", p=p, title=f"{schedule}: p={p}, m={m}, v={v}", bubble_note=note)
        except ImportError as e:
            logger.warning("%s; wrote only %s.json", e, name)
    per_stage = ", ".join(f"{1e3 * t:.2f}" for t in stage_seconds(events).values())
    logger.info("pipeline timeline written to %s.json/.png: %s; per-stage F+B+W per micro-batch [%s] ms",
                out / name, note, per_stage)
    return summary
