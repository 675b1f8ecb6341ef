"""From a model and its first batch to the IR: inputs, tracing, state,
verification, conversion."""
