"""Training through the converted graph: the three entry points
(`PluginModel` in `model.py`, `PluginCallback` in `callback.py`, `kip.scope`
in `scope.py`), the route a backend trains by (`routes.py`), what their
step functions run on (`session/`) and the pipelined step (`pipelined/`)."""
