"""TensorFlow's tracking wrappers around a layer's containers: the raw container and what a wrapper records.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import types

from tensorflow.python.trackable import data_structures as _tf_data_structures


def raw_container(value):
    """The builtin list, dict or set that holds `value`'s items, or None
    when `value` is not a mutable container.

    TensorFlow's tracking wrappers (which Keras puts around the attributes
    of a functional model once it has been called) are not the builtin
    containers they look like: a `_DictWrapper` is a proxy for which
    `isinstance(w, dict)` holds while `dict.clear(w)` raises TypeError, and a
    `ListWrapper` keeps its items in `_storage`, not in its `list` base.
    Keras's own TrackedList / TrackedDict / TrackedSet are real subclasses.
    Writing through the raw container with the builtin methods bypasses the
    wrappers' tracking, which would otherwise re-track every item put back.
    """
    kind = type(value)
    if kind in NEVER_CONTAINERS:  # most values: checked first, as this runs per attribute
        return None
    if kind in OWN_STORAGE:
        return value
    if isinstance(value, _tf_data_structures._DictWrapper):
        return value.__wrapped__
    if isinstance(value, _tf_data_structures.List):
        return value._storage
    if isinstance(value, (list, dict, set)):
        OWN_STORAGE.add(kind)
        return value
    NEVER_CONTAINERS.add(kind)
    return None


#: Types whose values `raw_container` found not to be containers (it learns
#: them), so that walking a model's attributes costs a set lookup per value.
NEVER_CONTAINERS = {bool, int, float, str, bytes, type(None), tuple}
#: Types whose values are their own raw container, with no wrapper
#: bookkeeping (`list`, Keras's `TrackedList`, ...; learnt likewise).
OWN_STORAGE = {list, dict, set}


_WRAPPER_BOOKKEEPING = {
    # The copy of its items a wrapper compares with to notice changes made
    # behind its back (after which saving the model fails), and its flags.
    "_DictWrapper": ("_self_last_wrapped_dict_snapshot", "_self_external_modification",
                     "_self_non_string_key"),
    "ListWrapper": ("_last_wrapped_list_snapshot", "_external_modification_value",
                    "_non_append_mutation_value"),
}


_NO_BOOKKEEPING = types.MappingProxyType({})


def wrapper_bookkeeping(container):
    """Copies of what a TensorFlow tracking wrapper records about its items
    (empty for other containers), for `restore_wrapper_bookkeeping`."""
    names = _WRAPPER_BOOKKEEPING.get(type(container).__name__)
    if names is None:
        return _NO_BOOKKEEPING  # shared: a snapshot asks for tens of thousands
    saved = {}
    for name in names:
        value = getattr(container, name, None)
        saved[name] = type(value)(value) if isinstance(value, (list, dict)) else value
    return saved


def restore_wrapper_bookkeeping(container, saved):
    for name, value in saved.items():
        value = type(value)(value) if isinstance(value, (list, dict)) else value
        if type(container).__name__ == "_DictWrapper":
            setattr(container, name, value)  # a `_self_` name: kept on the proxy
        else:
            object.__setattr__(container, name, value)
