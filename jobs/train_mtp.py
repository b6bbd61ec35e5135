"""Recipe `train_mtp`: train MTP draft heads for `model.path` by self-distillation.

    python -m pipeline.run +job=train_mtp [model.path=DIR mtp.steps=300 mtp.prompt_source=data ...]
"""
from pipeline.training.train_mtp import main  # noqa: F401
