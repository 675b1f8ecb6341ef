"""Why two traces of a call at two batch sizes are not one graph for any.

Example:
    >>> raise NotBatchGeneral("`block.reshape` is given 1 and 3")
"""


class NotBatchGeneral(Exception):
    """Two traces at different batch sizes differ other than by it."""


class MixedLeadingSizes(NotBatchGeneral):
    """An operation holds the leading sizes of two inputs whose leading
    dimensions are independent of each other: no one graph tensor gives
    both when the graph runs."""


__all__ = ["MixedLeadingSizes", "NotBatchGeneral"]
