"""The pass infrastructure, apart from the passes: `Pass`, targets and the
registry (`base.py`), target patterns (`patterns.py`, `Chain`), class names
in configs (`layer_class_names.py`), configs (`config.py`), passes inside a
`ModeSwitch`'s modes (`branches.py`) and `apply_passes` (`manager.py`).
The public names are re-exported by `keras_ipu_plugin.passes`."""
