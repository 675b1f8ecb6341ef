"""The layers a kip graph may hold, apart from what runs a graph: `LayerAlias`,
`OpaqueLayer`, variable reads and writes, `BatchSizedOperation`, `TFFunction`,
random draws, `AttachMask`; the checks their `from_config` makes on a file's
values (`saved_values.py`), the variables they share (`shared_variables.py`),
which layers are built-in, expandable or training-agnostic (`layer_kinds.py`),
and the views of user layers an `OpaqueLayer` runs (`views.py`, used by the
tracer too).

`ModeSwitch` is a layer too, but holds a rebuilt functional body per mode,
so it lives in `runtime/` with `rebuild` and `KipFunctional`."""
