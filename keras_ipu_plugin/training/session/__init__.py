"""What a model's train / test / predict functions run on, whichever entry
point installed them: the session of converted calls (`session.py`), the
step functions themselves (`step_functions.py`), what a custom `train_step`
calls, its `self` and the losses it sees (`calls.py`, `step_self.py`), and variables created after the first batch
(`new_variables.py`)."""
