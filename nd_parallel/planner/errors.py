"""The planner's one error type: every module below the search raises it, so it sits beneath all of them."""

from __future__ import annotations


class PlannerError(ValueError):
    """Input the planner cannot plan for; the message names the value and the fix."""
