"""Turning the IR into Keras models and running them: rebuild, the
functional model class, `ModeSwitch` (a layer holding one rebuilt graph per
mode), the executor, backends, distribution. The layers a graph holds are in
`keras_ipu_plugin.layers`."""
