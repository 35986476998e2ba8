"""The input side: every Keras input kind as rows (``inputs``), the balanced cut of a large
batch (``split``), the host ``tf.data`` pipeline of micro-batches (``pipeline``) and its
cut of sequences by length (``lengths``), keras_hub preprocessing (``hub``), where this
process sits in a ``tf.distribute`` job (``layout``).
"""
