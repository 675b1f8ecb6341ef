"""The pass infrastructure, apart from the passes: `Pass`, targets, the
registry and passes inside a `ModeSwitch`'s modes (`base.py`), target
patterns (`patterns.py`, `Chain`), class names in configs
(`layer_class_names.py`), configs (`config.py`) and `apply_passes`
(`manager.py`). The public names are re-exported by `keras_ipu_plugin.passes`."""
