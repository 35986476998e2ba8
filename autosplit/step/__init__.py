"""The compiled split step: one ``tf.function`` (``compiled``) that loops over micro-
batches (``loop``), sums float32 gradients and loss parts (``sums``, ``piece``,
``reduction``) and applies them once (``update``), per replica (``replicas``);
whether a model ignores padding (``padding``).
"""
