"""``async_save``: ``save_state`` returns once a copy of the state is staged; DCP writes it in a background thread.

Torch does the staging and writing (``dcp.async_save``); this module keeps at most one save in flight and publishes
the checkpoint (marker + rename, ``format.publish``) only when every rank's files are written, so an async save that
dies leaves the previous checkpoint as the latest, exactly as a synchronous one does. The background thread runs
DCP's collectives on a gloo group of its own: sharing the training's group would interleave them with the training's
collectives in an order the other ranks do not follow.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import torch.distributed as dist

logger = logging.getLogger("nd_parallel")

# Process-level on purpose: one process writes at most one checkpoint at a time, whatever plugin started it, and the
# exit path (fault/runtime.py) must find it.
_pending: list[tuple[Future, threading.Event, list]] = []
_group = None


def _checkpoint_group():
    """A gloo group over every rank, created once (a collective: every rank saves together)."""
    global _group
    if _group is None:
        _group = dist.new_group(backend="gloo")
    return _group


def start(state: dict, writer, no_dist: bool, finalize=None) -> Future:
    """Stage ``state`` now, write it in the background; ``finalize`` (main process) publishes it afterwards."""
    import torch.distributed.checkpoint as dcp

    wait_pending()  # the previous one first: two in flight would double the staged memory and race on publish
    group = None if no_dist else _checkpoint_group()
    result = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=no_dist)
    future = getattr(result, "upload_completion", result)  # newer torch returns staging + upload futures
    done, errors = threading.Event(), []

    def publish(fut: Future) -> None:
        try:
            fut.result()
            if finalize is not None:
                finalize()
        except BaseException as err:  # reported by wait_pending on the main thread
            errors.append(err)
        finally:
            done.set()

    future.add_done_callback(publish)
    _pending.append((future, done, errors))
    return future


def wait_pending() -> None:
    """Block until the checkpoint in flight is written and published; re-raise its error here."""
    while _pending:
        _, done, errors = _pending.pop(0)
        done.wait()
        if errors:
            raise errors[0]


def reset_group() -> None:
    """Forget the checkpoint group (its process group was destroyed)."""
    global _group
    _group = None
