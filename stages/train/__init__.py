"""The ``train`` kind: fitting the single-sample model's weights to the target, pixel by pixel."""
