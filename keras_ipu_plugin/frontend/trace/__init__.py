"""Tracing: one symbolic call of a layer's `call` walked back into IR nodes
(the `Tracer`, the trace in progress, its views, writes, losses and training modes)."""
