"""The compiled steps, training's and validation's: micro-batches summed, applied once."""
