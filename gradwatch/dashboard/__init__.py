"""The gradwatch tab in TensorBoard (a plugin TensorBoard finds through the package's entry point):
``data`` turns the event files gradwatch writes into the tab's tables; ``plugin`` serves them and
the page (``static/index.js``). Nothing here runs during training."""
