"""Every reach into Keras's private names, and the behaviours built on them."""
