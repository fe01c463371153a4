"""The exact contiguous split of per-unit costs into stages (pure: no model, no process group).

Kept apart from the measuring so that the optimisation can be checked exhaustively against brute force on
made-up costs, and reused on costs from anywhere (a profile, a planner's model of a cluster).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..split import check_layer_counts, uniform_layers


@dataclass(frozen=True)
class BalancePlan:
    """A split and what it is predicted to cost."""

    counts: list[int]  # decoder layers per stage
    stage_seconds: list[float]  # predicted forward+backward time of each stage for one micro-batch

    @property
    def bottleneck(self) -> float:
        return max(self.stage_seconds)

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage: 1.0 is perfect balance."""
        return self.bottleneck / (sum(self.stage_seconds) / len(self.stage_seconds))


def stage_times(costs: list[float], counts: list[int]) -> list[float]:
    """Per-stage cost of a split; ``costs`` = [embedding, layer 0 .. layer N-1, head]."""
    layers = costs[1:-1]
    out, start = [], 0
    for stage, count in enumerate(counts):
        total = sum(layers[start : start + count])
        start += count
        if stage == 0:
            total += costs[0]
        if stage == len(counts) - 1:
            total += costs[-1]
        out.append(total)
    return out


def _check_costs(costs: list[float], num_stages: int) -> int:
    num_layers = len(costs) - 2
    if num_layers < 1:
        raise ValueError(f"costs must be [embedding, layer costs..., head]; got {len(costs)} values")
    if any(not c >= 0 for c in costs):  # `not >=` also catches NaN
        raise ValueError(f"unit costs must be finite and >= 0, got {costs}")
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages; use 1 to {num_layers} stages")
    return num_layers


class _Stages:
    """What both passes of the dynamic program ask: a stage's cost, and the fewest layers it may hold."""

    def __init__(self, costs: list[float], num_stages: int, allow_empty_ends: bool):
        self.costs, self.num_stages, self.allow_empty_ends = costs, num_stages, allow_empty_ends
        self.prefix = [0.0]
        for c in costs[1:-1]:
            self.prefix.append(self.prefix[-1] + c)

    def cost(self, stage: int, i: int, j: int) -> float:
        """Cost of ``stage`` running layers [i, j)."""
        extra = (self.costs[0] if stage == 0 else 0.0) + (self.costs[-1] if stage == self.num_stages - 1 else 0.0)
        return self.prefix[j] - self.prefix[i] + extra

    def min_layers(self, stage: int) -> int:
        end = stage in (0, self.num_stages - 1)
        return 0 if end and self.allow_empty_ends and self.num_stages > 1 else 1


def _optimal_bottleneck(st: _Stages, num_layers: int) -> float:
    """The slowest stage of the best split. best[j] = slowest stage of the best split of layers [0, j) so far."""
    inf = float("inf")
    best = [st.cost(0, 0, j) if j >= st.min_layers(0) else inf for j in range(num_layers + 1)]
    for stage in range(1, st.num_stages):
        lo = st.min_layers(stage)
        best = [min((max(best[i], st.cost(stage, i, j)) for i in range(j - lo + 1) if best[i] < inf), default=inf)
                for j in range(num_layers + 1)]
    return best[num_layers]


def _closest_to_uniform(st: _Stages, num_layers: int, limit: float) -> list[int]:
    """Among the splits whose every stage costs at most ``limit``, the one closest (L1) to the uniform split."""
    inf = float("inf")
    target = uniform_layers(num_layers, st.num_stages)
    dist_ = [abs(j - target[0]) if j >= st.min_layers(0) and st.cost(0, 0, j) <= limit else inf
             for j in range(num_layers + 1)]
    choice: list[list[int]] = [[0] * (num_layers + 1)]
    for stage in range(1, st.num_stages):
        lo, new, pick = st.min_layers(stage), [inf] * (num_layers + 1), [0] * (num_layers + 1)
        for j in range(num_layers + 1):
            for i in range(j - lo + 1):  # ascending i and strict `<`: deterministic tie-breaking
                if dist_[i] < inf and st.cost(stage, i, j) <= limit:
                    d = dist_[i] + abs(j - i - target[stage])
                    if d < new[j]:
                        new[j], pick[j] = d, i
        dist_ = new
        choice.append(pick)
    return _backtrack(choice, num_layers)


def _backtrack(choice: list[list[int]], num_layers: int) -> list[int]:
    """Layers per stage from ``choice[stage][j]`` = where the stage ending at layer j starts."""
    counts, j = [], num_layers
    for stage in range(len(choice) - 1, 0, -1):
        i = choice[stage][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    counts.reverse()
    return counts


def partition(costs: list[float], num_stages: int, *, rtol: float = 0.0, allow_empty_ends: bool = True) -> BalancePlan:
    """Split the layers into ``num_stages`` contiguous stages so that the slowest stage is as fast as possible.

    ``costs`` = [embedding, layer 0 .. layer N-1, head], in any unit of time. Middle stages get at least one
    layer; the first and last stage may get none (then they run only the embedding / the head), which is
    what a large vocabulary can call for. Exact: a dynamic program over (stage, layers used), O(S * N^2).

    Among the splits whose slowest stage is within ``rtol`` of the optimum, the one closest to the uniform
    split is returned: measurements are noisy, and layers should not move for a difference below the noise.
    """
    num_layers = _check_costs(costs, num_stages)
    stages = _Stages(costs, num_stages, allow_empty_ends)
    optimum = _optimal_bottleneck(stages, num_layers)
    # The small absolute slack keeps an exact tie exact despite float sums taken in a different order.
    limit = optimum * (1.0 + rtol) + 1e-12 * max(1.0, abs(optimum))
    counts = _closest_to_uniform(stages, num_layers, limit)
    check_layer_counts(counts, num_layers, num_stages)
    return BalancePlan(counts, stage_times(costs, counts))
