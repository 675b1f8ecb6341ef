"""Balancing pipeline stages: a pure partition of a cost list.

A pipeline runs as fast as its slowest stage, so N stages over the graph's
nodes (in topological order, which keeps every stage reading only earlier
stages) are cut where the largest stage cost is smallest. Among the
partitions that reach it, the one with the most even costs (smallest sum of
squares) is taken, so a stage is not left nearly empty.

Example:
    >>> balanced_partition([4, 1, 1, 2, 2, 4], 3)
    [(0, 1), (2, 4), (5, 5)]
    >>> imbalance([5, 5, 4])
    1.0714285714285714
"""


class CannotPartition(ValueError):
    """There are fewer places to cut than the stages need."""


def balanced_partition(costs, num_stages, allowed_cuts=None):
    """`[(first, last)]` index ranges of `num_stages` contiguous, non-empty
    stages of `costs` with the smallest largest stage sum.

    `allowed_cuts`: the indices after which a stage may end (default: all);
    a layer called at several nodes, for example, has one stage, so no cut
    may separate its calls.

    Example:
        >>> balanced_partition([1, 1, 1, 1], 2, allowed_cuts={2})
        [(0, 2), (3, 3)]
    """
    n = len(costs)
    if num_stages < 1:
        raise CannotPartition(f"num_stages must be at least 1; got {num_stages}")
    cuts = [i for i in range(n - 1) if allowed_cuts is None or i in allowed_cuts]
    if num_stages - 1 > len(cuts):
        raise CannotPartition(
            f"{num_stages} stages need {num_stages - 1} cuts, but the {n} nodes allow "
            f"only {len(cuts)}")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))
    ends = cuts + [n - 1]  # where a stage may end; the last one ends at n - 1
    # best[k][e]: (largest, sum of squares, previous end) for k + 1 stages
    # over the nodes up to end e
    best = [{e: (prefix[e + 1], prefix[e + 1] ** 2, None) for e in ends}]
    for _ in range(1, num_stages):
        layer, previous = {}, best[-1]
        for e in ends:
            options = [
                (max(value[0], prefix[e + 1] - prefix[p + 1]),
                 value[1] + (prefix[e + 1] - prefix[p + 1]) ** 2, p)
                for p, value in previous.items() if p < e
            ]
            if options:
                layer[e] = min(options)
        best.append(layer)
    stages, end = [], n - 1
    for k in range(num_stages - 1, -1, -1):
        previous_end = best[k][end][2]
        first = 0 if previous_end is None else previous_end + 1
        stages.append((first, end))
        end = previous_end
    return stages[::-1]


def stage_sums(costs, stages):
    """The cost of each `(first, last)` stage."""
    return [float(sum(costs[first:last + 1])) for first, last in stages]


def imbalance(sums):
    """Largest / mean of the stage costs (1.0 is perfectly balanced)."""
    mean = sum(sums) / len(sums) if sums else 0.0
    return max(sums) / mean if mean else 1.0
