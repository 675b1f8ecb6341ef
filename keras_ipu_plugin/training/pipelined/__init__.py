"""The train step `PipelineStages(microbatches=M)` asks for (`step.py`) and
the microbatches it runs (`microbatches.py`)."""
