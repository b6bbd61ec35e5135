"""Training jobs for a user's checkpoint: `train_mtp` (MTP draft heads by self-distillation)."""
