"""Training through the converted graph: step functions, dynamic variables,
PluginModel, PluginCallback, kip.scope."""
