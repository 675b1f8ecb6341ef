"""Lists of variables, compared by identity (Keras compares variables by
value in `==`, so `in` on a list of them is wrong)."""


def union_of_variables(first, second):
    """The variables of `first` then those of `second` not already in it."""
    seen, merged = set(), []
    for variable in list(first) + list(second):
        if id(variable) not in seen:
            seen.add(id(variable))
            merged.append(variable)
    return merged
