"""What reaches into Keras: its private names (``internals``), BatchNormalization's pooled
statistics (``batchnorm``), models with their own ``train_step`` (``custom_step``),
facts read off a trace and the trace itself (``traced``), the checks of a model every
entry point makes (``checks``).
"""
