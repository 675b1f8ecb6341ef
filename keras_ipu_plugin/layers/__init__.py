"""The layers a kip graph may hold, apart from what runs a graph, and the
rules about layers that the tracer, the planners and the run-time effects
share.

Here: `LayerAlias` (`alias.py`), `OpaqueLayer` (`opaque.py`); which classes
are the user's, whose `call` takes `training`, and the views of user layers
(`user_code.py`, used by the tracer too); which
layers are built-in, expandable or training-agnostic (`layer_kinds.py`); the
checks every kip layer's `from_config` makes on a file's values
(`saved_values.py`). By what the layer holds:

- `state.py`: the model state a graph reads and writes (`VariableRead`,
  `HeldConstant`, `VariableWrite`, `AddedLoss`, shared variables);
- `keras_ops/`: `keras.ops` calls given graph values where Keras takes sizes
  or seeds (`BatchSizedOperation`, `TensorSizedOperation`, `RandomDraw`,
  `AttachMask`);
- `tf_calls.py`: TensorFlow functions and random draws called on graph
  tensors, resolved only from the explicit table it holds.

`ModeSwitch` is a layer too, but holds a rebuilt functional body per mode,
so it lives in `runtime/` with `rebuild` and `KipFunctional`."""
