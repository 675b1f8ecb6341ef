"""One way to make names unique: `Namespace`.

Node names in a graph, the Keras layer names of a rebuilt model, the names
of the layers Replace makes and of the reads a trace records all follow the
same rule: a name is used as it is when free, else numbered `name_1`,
`name_2`, ... (the first number free). One class, so that the rule is the
same everywhere, and numbering stays linear: a counter per base name means
the 500th `dense` does not try the 499 taken numbers before it.

Example:
    >>> names = Namespace(["dense"])
    >>> names.create("dense"), names.create("dense"), names.create("norm")
    ('dense_1', 'dense_2', 'norm')
"""


class Namespace:
    """A set of taken names that hands out free ones."""

    __slots__ = ("_taken", "_next")

    def __init__(self, names=()):
        self._taken = set(names)
        self._next = {}  # base name -> the first number that may be free

    def __contains__(self, name):
        return name in self._taken

    def __len__(self):
        return len(self._taken)

    def create(self, base):
        """`base` if free, else `base_<n>` for the first free n; taken."""
        if base not in self._taken:
            self._taken.add(base)
            return base
        count = self._next.get(base, 1)
        while f"{base}_{count}" in self._taken:
            count += 1
        self._next[base] = count + 1
        name = f"{base}_{count}"
        self._taken.add(name)
        return name

    def add(self, name):
        """Take `name` as it is (a name chosen elsewhere, known to be free)."""
        self._taken.add(name)

    def discard(self, name):
        """Free `name` (its node left the graph)."""
        self._taken.discard(name)
