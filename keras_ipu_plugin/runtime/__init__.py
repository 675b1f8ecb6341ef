"""Turning the IR into Keras models and running them: rebuild, the
functional model class, `ModeSwitch` (a layer holding one rebuilt graph per
mode), the interpreter and its run-time effects, backends, variables and their
strategies. The layers a graph holds are in
`keras_ipu_plugin.layers`."""
