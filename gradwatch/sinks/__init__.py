"""Where flushed statistics and alerts go (TensorBoard; alerts also go to logging)."""
