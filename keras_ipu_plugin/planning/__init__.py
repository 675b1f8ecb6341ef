"""Planning: costs of a graph's nodes (`node_costs.py`, measured on
TensorFlow), the pure planners (`recompute_plan.py`, `stage_balance.py`),
stage timing (`stage_timing.py`), and `graph_planning.py`, which adapts the
graph IR to the planners and puts their plans back as annotations. The
annotation passes (`passes/annotate.py`) call it; it knows no pass."""
