"""Training: optimizers (NorMuon + AdamW routing), LR and pass schedules, data, checkpoints, the trainer.
Import the submodules directly (fullband.train.optim, fullband.train.schedule); nothing heavy loads here."""
