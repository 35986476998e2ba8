"""The input side: every Keras input kind as rows, cut into micro-batches on the host."""
