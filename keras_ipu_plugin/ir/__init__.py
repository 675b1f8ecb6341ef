"""The graph IR: nodes, values, names. Depends on nothing above it."""
