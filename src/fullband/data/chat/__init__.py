"""Chat data, one concern a module: messages (conversations checked), templates (rendering and the training
sequence), arithmetic (the synthetic set), sources (chat corpora), packing (windows). Import the modules directly."""
